"""Sliding windows and attention sinks in the Triton kernels and the torch backend.

Windows shorter than the contexts, against a dense float64 reference, on decode (with and
without split-KV), prefill after a cached prefix (chunks of a long prompt), fresh prompts and
mixed steps, in float32 (float16 once), with an FP8 cache too. Pages wholly left of each
sequence's window are pointed at a page of NaN before the step (what a KV manager that freed
them may leave): a backend that reads one poisons its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from paged_batches import (
    PagedBatch,
    dense_reference,
    drop_pages_left_of_window,
    make_batch,
    tolerance,
)

from pagedinfer.adapters.attention.base import PagedAttentionBackend
from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend
from pagedinfer.adapters.attention.triton import TritonAttentionBackend
from pagedinfer.adapters.kernels.prefill_attention import PrefillTiles, paged_prefill_attention
from pagedinfer.adapters.kernels.store_kv import store_kv_cache


@dataclass(frozen=True)
class Case:
    decode_contexts: list[int]  # one query token each (decode rows first)
    chunks: list[tuple[int, int]]  # (query length, context length) of each prefill chunk
    window: int
    sinks: bool = False
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 16

    def batch(self, dtype: torch.dtype, device: torch.device) -> PagedBatch:
        query_lens = [1] * len(self.decode_contexts) + [q for q, _ in self.chunks]
        contexts = [*self.decode_contexts, *(ctx for _, ctx in self.chunks)]
        decode_only = not self.chunks
        batch = make_batch(
            query_lens,
            contexts,
            block_size=self.block_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            device=device,
            is_prefill=not decode_only,
            num_decode_rows=0
            if decode_only or not self.decode_contexts
            else len(self.decode_contexts),
        )
        drop_pages_left_of_window(batch, self.window)
        return batch

    def sink_logits(self, device: torch.device) -> torch.Tensor | None:
        if not self.sinks:
            return None
        generator = torch.Generator().manual_seed(1)
        return (torch.randn(self.num_heads, generator=generator) * 2.0).to(device)


CASES = {
    # Decode rows past the window, one inside it, one on a page edge.
    "decode": Case([70, 5, 33], [], window=20),
    "decode-sinks": Case([70, 5, 48], [], window=16, sinks=True),
    # A fresh prompt longer than the window; chunks after a cached prefix, one starting past
    # the window; a one-token chunk. The window is shorter than a prefill tile.
    "prefill": Case([], [(40, 40), (24, 90), (1, 9), (30, 31)], window=12),
    "prefill-sinks": Case([], [(40, 40), (20, 70)], window=24, sinks=True),
    # Mixed: decode rows first, then chunks; a window wider than some contexts.
    "mixed-sinks": Case([50, 3], [(20, 20), (17, 80)], window=36, sinks=True, num_kv_heads=1),
}


def attend(backend: PagedAttentionBackend, spec: Case, batch: PagedBatch) -> torch.Tensor:
    # The torch backend gathers padding rows' table entries before masking: no NaN for it.
    clean = isinstance(backend, TorchAttentionBackend)
    k_cache, v_cache = batch.clean_caches() if clean else (batch.k_cache, batch.v_cache)
    return backend.forward(
        batch.query, batch.key, batch.value, k_cache, v_cache, batch.meta,
        batch.scale, window=spec.window, sinks=spec.sink_logits(batch.query.device),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("case", "dtype"),
    [(name, torch.float32) for name in sorted(CASES) if name != "mixed-sinks"]
    + [("mixed-sinks", torch.float16)],
)
def test_window_and_sinks_match_the_dense_reference(
    case: str, dtype: torch.dtype, device: torch.device
) -> None:
    spec = CASES[case]
    backends: list[PagedAttentionBackend] = [
        TritonAttentionBackend(spec.block_size),
        TorchAttentionBackend(spec.block_size),
    ]
    if spec.decode_contexts:
        backends.append(TritonAttentionBackend(spec.block_size, num_splits=3))
    if spec.chunks and spec.decode_contexts:
        backends.append(TritonAttentionBackend(spec.block_size, split_mixed_steps=False))
    for backend in backends:
        batch = spec.batch(dtype, device)
        expected = dense_reference(
            batch, window=spec.window, sinks=spec.sink_logits(torch.device("cpu"))
        )
        out = attend(backend, spec, batch)
        torch.testing.assert_close(
            out.double().cpu(), expected, **tolerance(dtype), msg=f"{backend!r}"
        )


def test_a_window_wider_than_every_context_is_plain_causal_attention(
    device: torch.device,
) -> None:
    spec = Case([30], [(20, 20), (8, 40)], window=1000)
    batch = spec.batch(torch.float32, device)
    expected = dense_reference(batch)
    out = attend(TritonAttentionBackend(16), spec, batch)
    torch.testing.assert_close(out.double().cpu(), expected, **tolerance(torch.float32))


def test_prefill_tiles_cross_the_window_edge_in_every_phase(device: torch.device) -> None:
    """Small tiles on a long chunk: tiles whose rows start their windows in different key
    tiles, tiles of keys every row sees, and the diagonal; windows shorter and longer than
    a tile of queries."""
    for window in (5, 23):
        batch = make_batch(
            [70], [100], block_size=16, num_heads=2, num_kv_heads=1, head_dim=16, device=device
        )
        drop_pages_left_of_window(batch, window)
        store_kv_cache(
            batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping
        )
        out = paged_prefill_attention(
            batch.query, batch.k_cache, batch.v_cache, cu_seqlens_q=batch.meta.cu_seqlens_q,
            context_lens=batch.meta.context_lens, block_tables=batch.meta.block_tables,
            max_seqlen_q=batch.meta.max_seqlen_q, scale=batch.scale, window=window,
            tiles=PrefillTiles(block_m=16, block_n=16, num_warps=4, num_stages=1),
        )  # fmt: skip
        expected = dense_reference(batch, window=window)
        torch.testing.assert_close(out.double().cpu(), expected, **tolerance(torch.float32))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn], ids=["e4m3"])
def test_window_and_sinks_with_an_fp8_cache_match_the_torch_backend(
    cache_dtype: torch.dtype, device: torch.device
) -> None:
    spec = CASES["mixed-sinks"]
    outs = []
    for backend in (TritonAttentionBackend(16), TorchAttentionBackend(16)):
        batch = spec.batch(torch.float32, device)
        k_cache = torch.zeros_like(batch.k_cache, dtype=cache_dtype)
        v_cache = torch.zeros_like(batch.v_cache, dtype=cache_dtype)
        # The cached prefix, quantized as the store would.
        k_cache.copy_(batch.k_cache.nan_to_num(0.0).to(cache_dtype))
        v_cache.copy_(batch.v_cache.nan_to_num(0.0).to(cache_dtype))
        scales = torch.tensor([1.0, 1.0, 1.0, 1.0], device=device)
        outs.append(
            backend.forward(
                batch.query,
                batch.key,
                batch.value,
                k_cache,
                v_cache,
                batch.meta,
                batch.scale,
                kv_scales=scales,
                window=spec.window,
                sinks=spec.sink_logits(device),
            )
        )
    torch.testing.assert_close(outs[0].cpu(), outs[1].cpu(), atol=2e-3, rtol=2e-3)
