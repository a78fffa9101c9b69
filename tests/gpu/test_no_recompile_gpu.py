"""Decode attention compiles once: batch sizes, split counts and table widths that change from
step to step must not compile new kernel variants mid-run (each compile takes ~1 s).

Counts the entries of Triton's per-device kernel cache (``JITFunction.device_caches``, Triton
3.x); skipped if that internal moved. Run with ``make test-gpu``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def compiled_variants(kernel: Any) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton version keeps its kernel cache elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


def test_decode_compiles_one_variant_for_every_split_count_and_width() -> None:
    from pagedinfer.adapters.kernels import decode_attention
    from pagedinfer.adapters.kernels.decode_attention import (
        SplitPartials,
        paged_decode_attention,
        split_workspace_numel,
    )

    device = torch.device("cuda")
    heads, kv_heads, head_dim, block_size = 16, 8, 128, 16
    k_cache = torch.randn(64, block_size, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    workspace = torch.empty(1 << 22, device=device)
    before_decode = compiled_variants(decode_attention._decode_kernel)
    before_reduce = compiled_variants(decode_attention._reduce_splits_kernel)
    for num_seqs, width, num_splits in [
        (1, 1, 1), (3, 4, 2), (5, 16, 3), (7, 17, 16), (33, 32, 1), (2, 48, 5), (1, 64, 8),
    ]:  # fmt: skip
        query = torch.randn(num_seqs, heads, head_dim, device=device, dtype=torch.bfloat16)
        tables = torch.randint(0, 64, (num_seqs, width), device=device, dtype=torch.int32)
        context_lens = torch.randint(1, width * block_size + 1, (num_seqs,), device=device)
        partials = None
        if num_splits > 1:
            assert split_workspace_numel(num_seqs, heads, num_splits, head_dim) <= 1 << 22
            partials = SplitPartials.from_buffer(workspace, num_seqs, heads, num_splits, head_dim)
        paged_decode_attention(
            query,
            k_cache,
            v_cache,
            context_lens=context_lens.int(),
            block_tables=tables,
            scale=head_dim**-0.5,
            num_splits=num_splits,
            partials=partials,
        )
    torch.cuda.synchronize()
    assert compiled_variants(decode_attention._decode_kernel) - before_decode <= 1
    assert compiled_variants(decode_attention._reduce_splits_kernel) - before_reduce <= 1
