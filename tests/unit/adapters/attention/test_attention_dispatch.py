"""The dispatch every backend inherits (``PagedAttentionBackend``): the store first, then the
prefill kernel, the decode kernel, or both over the two parts of a mixed step."""

from __future__ import annotations

from typing import ClassVar

import torch

from pagedinfer.adapters.attention.base import AttentionMetadata, PagedAttentionBackend

HEADS, DIM = 2, 4
PREFILL_VALUE, DECODE_VALUE = 1.0, 2.0


class Recording(PagedAttentionBackend):
    """Kernels that record their calls and fill their rows with a kernel-specific value."""

    name: ClassVar[str] = "recording"
    supports_cuda_graphs: ClassVar[bool] = False

    def __init__(self, *, split_mixed_steps: bool = True) -> None:
        super().__init__(16, split_mixed_steps=split_mixed_steps)
        self.calls: list[tuple[object, ...]] = []
        # window, sinks, softcap
        self.layer_kinds: list[tuple[int | None, torch.Tensor | None, float | None]] = []

    def _store(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        has_padding_slots: bool,
        kv_scales: torch.Tensor | None,
    ) -> None:
        self.calls.append(("store", slot_mapping.tolist(), has_padding_slots, kv_scales))

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None,
        out: torch.Tensor | None,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        assert key is not None and key.shape[0] == query.shape[0]
        self.calls.append(("prefill", query.shape[0], meta.cu_seqlens_q.tolist()))
        self.layer_kinds.append((window, sinks, softcap))
        return _filled(query, out, PREFILL_VALUE)

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None,
        out: torch.Tensor | None,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        assert not meta.is_prefill
        self.calls.append(("decode", query.shape[0], meta.context_lens.tolist()))
        self.layer_kinds.append((window, sinks, softcap))
        return _filled(query, out, DECODE_VALUE)


def _filled(query: torch.Tensor, out: torch.Tensor | None, value: float) -> torch.Tensor:
    target = torch.empty_like(query) if out is None else out
    return target.fill_(value)


def _meta(
    query_lens: list[int], context_lens: list[int], *, decode_rows: int = 0
) -> AttentionMetadata:
    cu_q, cu_k = [0], [0]
    for q, k in zip(query_lens, context_lens, strict=True):
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + k)
    is_prefill = decode_rows > 0 or any(q > 1 for q in query_lens)
    return AttentionMetadata(
        is_prefill=is_prefill,
        block_size=16,
        slot_mapping=torch.arange(cu_q[-1]),
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.zeros((len(query_lens), 1), dtype=torch.int32),
        max_seqlen_q=max(query_lens),
        max_seqlen_k=max(context_lens),
        has_cached_prefix=any(k > q for q, k in zip(query_lens, context_lens, strict=True)),
        query_lens_host=query_lens,
        context_lens_host=context_lens,
        num_decode_rows=decode_rows,
    )


def _run(backend: Recording, meta: AttentionMetadata) -> torch.Tensor:
    tokens = int(meta.cu_seqlens_q[-1])
    query = torch.zeros(tokens, HEADS, DIM)
    key = torch.zeros(tokens, 1, DIM)
    cache = torch.zeros(1, 16, 1, DIM)
    return backend.forward(query, key, key, cache, cache, meta, 1.0)


def test_a_prefill_step_stores_then_runs_the_prefill_kernel() -> None:
    backend = Recording()
    out = _run(backend, _meta([3, 2], [3, 4]))
    assert backend.calls == [
        ("store", [0, 1, 2, 3, 4], False, None),
        ("prefill", 5, [0, 3, 5]),
    ]
    assert torch.all(out == PREFILL_VALUE)


def test_a_decode_step_runs_the_decode_kernel() -> None:
    backend = Recording()
    out = _run(backend, _meta([1, 1], [5, 9]))
    assert backend.calls[1:] == [("decode", 2, [5, 9])]
    assert torch.all(out == DECODE_VALUE)


def test_a_mixed_step_runs_each_part_through_its_kernel_into_one_output() -> None:
    backend = Recording()
    out = _run(backend, _meta([1, 1, 3], [5, 7, 3], decode_rows=2))
    assert backend.calls[1:] == [
        ("decode", 2, [5, 7]),
        ("prefill", 3, [0, 3]),  # the prefill part's offsets start at its first token
    ]
    assert torch.all(out[:2] == DECODE_VALUE) and torch.all(out[2:] == PREFILL_VALUE)


def test_without_split_mixed_steps_the_prefill_kernel_serves_every_row() -> None:
    backend = Recording(split_mixed_steps=False)
    out = _run(backend, _meta([1, 1, 3], [5, 7, 3], decode_rows=2))
    assert backend.calls[1:] == [("prefill", 5, [0, 1, 2, 5])]
    assert torch.all(out == PREFILL_VALUE)


def test_store_kv_alone_may_see_padding_slots_and_passes_the_scales() -> None:
    backend = Recording()
    key = torch.zeros(2, 1, DIM)
    cache = torch.zeros(1, 16, 1, DIM)
    scales = torch.ones(4)
    backend.store_kv(key, key, cache, cache, torch.tensor([3, -1]), kv_scales=scales)
    assert backend.calls == [("store", [3, -1], True, scales)]


def test_the_layer_window_sinks_and_softcap_reach_both_kernels_of_a_mixed_step() -> None:
    backend = Recording()
    meta = _meta([1, 3], [5, 3], decode_rows=1)
    query, key, cache = (
        torch.zeros(4, HEADS, DIM),
        torch.zeros(4, 1, DIM),
        torch.zeros(1, 16, 1, DIM),
    )
    sinks = torch.ones(HEADS)
    backend.forward(query, key, key, cache, cache, meta, 1.0, window=7, sinks=sinks, softcap=5.0)
    assert [kind[0] for kind in backend.layer_kinds] == [7, 7]
    assert all(kind[1] is sinks for kind in backend.layer_kinds)
    assert [kind[2] for kind in backend.layer_kinds] == [5.0, 5.0]
    _run(backend, _meta([2], [2]))  # a layer without a window, sinks or softcap
    assert backend.layer_kinds[-1] == (None, None, None)
