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


def compiled_layer_and_attention_variants() -> dict[str, int]:
    """Compiled variants of the kernels every forward pass runs, by kernel."""
    from pagedinfer.adapters.kernels import (
        add_rms_norm,
        decode_attention,
        prefill_attention,
        qk_norm_rope,
        silu_and_mul,
        store_kv,
    )

    kernels = {
        "add_rms_norm": add_rms_norm._add_rms_norm_kernel,
        "decode": decode_attention._decode_kernel,
        "reduce_splits": decode_attention._reduce_splits_kernel,
        "prefill": prefill_attention._prefill_kernel,
        "qk_norm_rope": qk_norm_rope._qk_norm_rope_kernel,
        "silu_and_mul": silu_and_mul._silu_and_mul_kernel,
        "store_kv": store_kv._store_kv_kernel,
    }
    return {name: compiled_variants(kernel) for name, kernel in kernels.items()}


def test_mixed_steps_compile_nothing_after_a_plain_start(make_checkpoint: Any) -> None:
    """Seen on an H100: the first run of the GPU report's workload compiled two prefill
    variants (~1 s each) in its mixed steps, whose prefill rows' int32 metadata are slices
    starting after the decode rows (4-byte, not 16-byte, aligned)."""
    from pagedinfer import Engine, SamplingParams

    with Engine(
        str(make_checkpoint("tiny")),
        device="cuda",
        dtype="bfloat16",
        attention_backend="triton",
        kv_block_size=16,
        max_model_len=1024,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        num_kv_blocks=512,
    ) as engine:
        sampled = SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True)
        engine.generate([[1, 2, 3]], sampled, use_tqdm=False)  # a plain prefill, then decode
        torch.cuda.synchronize()
        before = compiled_layer_and_attention_variants()
        num_mixed = engine.scheduler.stats().num_mixed_steps
        params = SamplingParams(temperature=0.6, max_tokens=24, ignore_eos=True)
        # Requests arriving one per step while others decode: mixed steps with 1, 2, 3, ...
        # decode rows ahead of prompt chunks of every length.
        for index in range(13):
            engine.add_request([(5 * index + j) % 500 + 1 for j in range(37 + 29 * index)], params)
            engine.step()
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        assert engine.scheduler.stats().num_mixed_steps - num_mixed >= 5
        assert compiled_layer_and_attention_variants() == before
