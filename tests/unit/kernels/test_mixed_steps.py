"""Mixed steps (decode rows first, then prefill chunks) in every CPU-testable backend.

The triton kernels run under ``TRITON_INTERPRET=1`` on the CPU (compiled on a GPU). Each
backend runs a mixed step both ways: split into its decode part and its prefill part (the
default) and with the prefill path serving every row; all four results must match a dense
float64 reference, in float32 and float16. The split metadata must equal the metadata of the
two parts planned on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from paged_batches import PagedBatch, dense_reference, make_batch, tolerance

from pagedinfer.adapters.attention.base import AttentionMetadata
from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend
from pagedinfer.adapters.attention.triton import TritonAttentionBackend


@dataclass(frozen=True)
class Case:
    decode_contexts: list[int]  # one query token each
    chunks: list[tuple[int, int]]  # (query length, context length) of each prefill chunk
    block_size: int = 16
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32

    def batch(self, dtype: torch.dtype, device: torch.device) -> PagedBatch:
        return make_batch(
            [1] * len(self.decode_contexts) + [q for q, _ in self.chunks],
            [*self.decode_contexts, *(ctx for _, ctx in self.chunks)],
            block_size=self.block_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            device=device,
            num_decode_rows=len(self.decode_contexts),
        )


CASES = {
    # Ragged decode contexts (one long enough for split-KV), a fresh prompt, a chunk after a
    # cached prefix (wider block table than any decode row), a one-token chunk.
    "ragged-gqa2": Case([70, 2, 33, 129], [(20, 20), (24, 90), (1, 9)]),
    # Every query head of a KV head in one decode tile; a chunk narrower than the decode rows.
    "gqa4-block32": Case(
        [5, 100], [(7, 7), (3, 40)], block_size=32, num_heads=8, num_kv_heads=2, head_dim=16
    ),
}


def run(backend: object, batch: PagedBatch, clean: bool) -> torch.Tensor:
    k_cache, v_cache = batch.clean_caches() if clean else (batch.k_cache, batch.v_cache)
    out: torch.Tensor = backend.forward(  # type: ignore[attr-defined]
        batch.query, batch.key, batch.value, k_cache, v_cache, batch.meta, batch.scale
    )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mixed_steps_match_the_dense_reference_split_or_not(
    case: str, dtype: torch.dtype, device: torch.device
) -> None:
    spec = CASES[case]
    expected = None
    for split in (True, False):
        backends: list[object] = [
            TritonAttentionBackend(spec.block_size, split_mixed_steps=split),
            TorchAttentionBackend(spec.block_size, split_mixed_steps=split),
        ]
        if split:  # the decode part with split-KV partitions and their reduction
            backends.append(TritonAttentionBackend(spec.block_size, num_splits=3))
        for backend in backends:
            batch = spec.batch(dtype, device)  # fresh caches: forward stores this step's K/V
            assert batch.meta.is_mixed
            # The torch backend gathers whole pages before masking: give it no NaN poison.
            out = run(backend, batch, clean=isinstance(backend, TorchAttentionBackend))
            if expected is None:
                expected = dense_reference(batch)
            torch.testing.assert_close(
                out.double().cpu(), expected, **tolerance(dtype), msg=f"{backend!r} {split=}"
            )


def test_the_parts_of_a_mixed_step_are_the_steps_planned_alone(device: torch.device) -> None:
    spec = CASES["ragged-gqa2"]
    batch = spec.batch(torch.float32, device)
    decode, prefill = batch.meta.split_mixed()
    assert batch.meta.split_mixed()[0] is decode  # derived once per step
    rows = len(spec.decode_contexts)
    alone = [
        make_batch(
            q_lens, ctx_lens, block_size=16, num_heads=4, num_kv_heads=2, head_dim=32, device=device
        ).meta
        for q_lens, ctx_lens in (
            ([1] * rows, spec.decode_contexts),
            ([q for q, _ in spec.chunks], [ctx for _, ctx in spec.chunks]),
        )
    ]
    for part, planned, is_prefill in ((decode, alone[0], False), (prefill, alone[1], True)):
        assert part.is_prefill is is_prefill and not part.is_mixed
        for name in ("cu_seqlens_q", "cu_seqlens_k", "context_lens"):
            assert torch.equal(getattr(part, name), getattr(planned, name)), name
        assert part.query_lens_host == planned.query_lens_host
        assert part.context_lens_host == planned.context_lens_host
        assert part.max_seqlen_k == planned.max_seqlen_k
        assert part.has_cached_prefix == planned.has_cached_prefix
    assert prefill.max_seqlen_q == 24 and decode.max_seqlen_q == 1
    # Views of the step's tensors: the block tables are the step's rows (pages differ from
    # the separately built batches, which draw their own).
    assert decode.block_tables.data_ptr() == batch.meta.block_tables.data_ptr()
    assert torch.equal(prefill.block_tables, batch.meta.block_tables[rows:])
    assert torch.equal(prefill.slot_mapping, batch.meta.slot_mapping[rows:])


def test_decode_and_prefill_steps_are_not_mixed(device: torch.device) -> None:
    decode = make_batch(
        [1, 1],
        [5, 9],
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        is_prefill=False,
        device=device,
    ).meta
    prefill = make_batch(
        [1, 4], [5, 9], block_size=16, num_heads=4, num_kv_heads=2, head_dim=32, device=device
    ).meta
    assert isinstance(decode, AttentionMetadata)
    assert (decode.is_mixed, prefill.is_mixed) == (False, False)
    with pytest.raises(AssertionError, match="two parts"):
        prefill.split_mixed()


@pytest.mark.parametrize("split", [True, False])
def test_a_split_mixed_step_runs_the_decode_kernel_on_the_decode_rows_only(
    split: bool, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedinfer.adapters.attention import triton as triton_backend

    calls: list[tuple[str, int]] = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        original = getattr(triton_backend, name)

        def spy(
            query: torch.Tensor,
            *args: object,
            _f: object = original,
            _n: str = name,
            **kwargs: object,
        ) -> torch.Tensor:
            calls.append((_n, int(query.shape[0])))
            return _f(query, *args, **kwargs)  # type: ignore[operator, no-any-return]

        monkeypatch.setattr(triton_backend, name, spy)
    spec = CASES["ragged-gqa2"]
    batch = spec.batch(torch.float32, device)
    run(TritonAttentionBackend(16, split_mixed_steps=split), batch, clean=False)
    num_tokens = batch.query.shape[0]
    rows = len(spec.decode_contexts)
    if split:
        expected = [
            ("paged_decode_attention", rows),
            ("paged_prefill_attention", num_tokens - rows),
        ]
    else:
        expected = [("paged_prefill_attention", num_tokens)]
    assert calls == expected
