"""Attention-logit softcapping (``cap * tanh(scores / cap)`` after the scale, before the
masks) in the Triton kernels, the torch backend and batch-invariant attention.

Against a dense float64 reference on decode (with and without split-KV), prefill after a
cached prefix, mixed steps with a sliding window and sinks, in float32 and float16; with an
FP8 cache against the torch backend. The cap is small next to the scores, so an uncapped
kernel misses the reference by far more than the tolerance (checked, so the tests can fail).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from paged_batches import PagedBatch, dense_reference, make_batch, tolerance

from pagedinfer.adapters.attention.base import PagedAttentionBackend
from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend
from pagedinfer.adapters.attention.triton import TritonAttentionBackend
from pagedinfer.adapters.batch_invariant import BatchInvariantAttention

CAP = 0.75


@dataclass(frozen=True)
class Case:
    decode_contexts: list[int]  # one query token each (decode rows first)
    chunks: list[tuple[int, int]]  # (query length, context length) of each prefill chunk
    window: int | None = None
    sinks: bool = False

    def batch(self, dtype: torch.dtype, device: torch.device) -> PagedBatch:
        query_lens = [1] * len(self.decode_contexts) + [q for q, _ in self.chunks]
        contexts = [*self.decode_contexts, *(ctx for _, ctx in self.chunks)]
        decode_only = not self.chunks
        batch = make_batch(
            query_lens, contexts, block_size=16, num_heads=4, num_kv_heads=2, head_dim=16,
            dtype=dtype, device=device, is_prefill=not decode_only,
            num_decode_rows=0 if decode_only or not self.decode_contexts
            else len(self.decode_contexts),
        )  # fmt: skip
        # Scores of a few units: a cap of 0.75 changes them a lot.
        batch.query.mul_(3.0)
        return batch

    def sink_logits(self, device: torch.device) -> torch.Tensor | None:
        if not self.sinks:
            return None
        return torch.tensor([0.5, -1.0, 0.0, 1.5], device=device)


CASES = {
    "decode": Case([40, 5, 17], []),
    "prefill": Case([], [(20, 20), (12, 37), (1, 9)]),
    "mixed-window-sinks": Case([33, 3], [(20, 20), (9, 40)], window=12, sinks=True),
}


def attend(
    backend: PagedAttentionBackend, spec: Case, batch: PagedBatch, softcap: float | None
) -> torch.Tensor:
    # The torch paths gather padding rows' table entries before masking: no NaN for them.
    clean = not isinstance(backend, TritonAttentionBackend)
    k_cache, v_cache = batch.clean_caches() if clean else (batch.k_cache, batch.v_cache)
    return backend.forward(
        batch.query, batch.key, batch.value, k_cache, v_cache, batch.meta, batch.scale,
        window=spec.window, sinks=spec.sink_logits(batch.query.device), softcap=softcap,
    )  # fmt: skip


def _triton(num_splits: int | None = None) -> PagedAttentionBackend:
    return TritonAttentionBackend(16, num_splits=num_splits)


def _torch() -> PagedAttentionBackend:
    return TorchAttentionBackend(16)


def _invariant() -> PagedAttentionBackend:
    return BatchInvariantAttention(TorchAttentionBackend(16))


RUNS = [
    ("decode", torch.float32, [_triton, lambda: _triton(3), _torch]),
    ("prefill", torch.float32, [_triton, _torch, _invariant]),
    ("mixed-window-sinks", torch.float32, [_triton, _torch, _invariant]),
    ("mixed-window-sinks", torch.float16, [_triton]),
]


@pytest.mark.parametrize(("case", "dtype", "backends"), RUNS, ids=[f"{r[0]}-{r[1]}" for r in RUNS])
def test_capped_attention_matches_the_dense_reference(
    case: str,
    dtype: torch.dtype,
    backends: list[Callable[[], PagedAttentionBackend]],
    device: torch.device,
) -> None:
    spec = CASES[case]
    batch = spec.batch(dtype, device)
    sinks = spec.sink_logits(torch.device("cpu"))
    expected = dense_reference(batch, window=spec.window, sinks=sinks, softcap=CAP)
    uncapped = dense_reference(batch, window=spec.window, sinks=sinks)
    assert (expected - uncapped).abs().max() > 50 * tolerance(dtype)["atol"]
    for make in backends:
        backend = make()
        out = attend(backend, spec, spec.batch(dtype, device), CAP)
        torch.testing.assert_close(
            out.double().cpu(), expected, **tolerance(dtype), msg=f"{backend!r}"
        )


def test_a_cap_of_zero_is_no_cap(device: torch.device) -> None:
    spec = CASES["prefill"]
    batch = spec.batch(torch.float32, device)
    expected = dense_reference(batch)
    out = attend(TritonAttentionBackend(16), spec, batch, 0.0)
    torch.testing.assert_close(out.double().cpu(), expected, **tolerance(torch.float32))


def test_capped_attention_with_an_fp8_cache_matches_the_torch_backend(
    device: torch.device,
) -> None:
    spec = CASES["mixed-window-sinks"]
    outs = []
    for backend in (TritonAttentionBackend(16), TorchAttentionBackend(16)):
        batch = spec.batch(torch.float32, device)
        k_cache = batch.k_cache.nan_to_num(0.0).to(torch.float8_e4m3fn)
        v_cache = batch.v_cache.nan_to_num(0.0).to(torch.float8_e4m3fn)
        scales = torch.tensor([0.5, 0.25, 2.0, 4.0], device=device)
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
                softcap=CAP,
            )
        )
    torch.testing.assert_close(outs[0].cpu(), outs[1].cpu(), atol=2e-3, rtol=2e-3)
