"""The attention-backend contract and the per-step metadata every backend reads.

There is no global "context": the model runner builds one :class:`AttentionMetadata` per step
from the :class:`~pagedinfer.domain.BatchPlan` and passes it down through the model's
``forward`` explicitly.

Shapes (``T`` query tokens this step, ``B`` sequences, ``W`` block-table width):

* query ``[T, num_heads, head_dim]``, key / value ``[T, num_kv_heads, head_dim]``
* one layer's cache ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``
* output ``[T, num_heads, head_dim]``
* ``kv_scales`` (FP8 caches only): the layer's float32 scale row ``[k_scale, v_scale,
  1 / k_scale, 1 / v_scale]`` (see :mod:`pagedinfer.adapters.kv_cache`); a backend knows the
  cache is FP8 from its dtype. ``None`` with a float8 cache means scales of 1.0.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import torch

from pagedinfer.adapters.plan_arrays import plan_tensor
from pagedinfer.domain.plan import BatchPlan

__all__ = ["AttendsStoredKV", "AttentionBackend", "AttentionMetadata"]


@dataclass(slots=True)
class AttentionMetadata:
    """What attention needs to know about one step, as device tensors plus a few host ints.

    ``context_lens[i]`` is the number of K/V tokens sequence ``i`` attends to *including* the
    tokens stored this step; its queries are the last ``query_lens[i]`` of those positions.
    ``slot_mapping[t]`` is where token ``t``'s K/V go (``block_id * block_size + offset``; ``-1``
    skips the store, used for padding rows of captured CUDA graphs).
    The ``*_host`` lists mirror tensors for backends that loop on the host; they are ``None``
    on the CUDA-graph decode path, whose tensors are overwritten in place between replays.
    ``derived`` holds what a backend derives from this step's metadata once and reuses in every
    layer (index tensors, masks), keyed by the backend; it lives and dies with the step.

    A *mixed* step (``is_prefill`` with ``num_decode_rows = D > 0``) holds decode rows first:
    rows ``0..D-1`` are one query token each (tokens ``0..D-1``) over their cached context,
    the other rows prefill chunks. :meth:`split_mixed` views it as a decode step and a prefill
    step, which backends attend to with their decode and prefill kernels in one forward.
    """

    is_prefill: bool
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W] int32
    max_seqlen_q: int
    max_seqlen_k: int
    has_cached_prefix: bool  # some sequence attends to K/V stored in earlier steps
    has_padding_slots: bool = False  # some slot_mapping entries are -1
    query_lens_host: list[int] | None = None
    context_lens_host: list[int] | None = None
    num_decode_rows: int = 0  # leading decode rows (BatchPlan.num_decode_rows)
    derived: dict[str, object] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def is_mixed(self) -> bool:
        """True for a step with decode rows and prefill chunks."""
        return self.is_prefill and self.num_decode_rows > 0

    def split_mixed(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """A mixed step's decode part (rows and tokens ``0..D-1``) and prefill part (rows
        ``D..``, tokens ``D..``), as metadata of a decode and a prefill step of their own.

        Derived once per step (kept in ``derived``, so every layer reuses the parts and what
        backends derive from them): views of this step's tensors, plus two small device ops
        re-basing the prefill part's prefix sums. Mixed steps are never captured in CUDA
        graphs, so the host mirrors are there to read.
        """
        cached = self.derived.get("mixed_parts")
        if cached is not None:
            return cached  # type: ignore[return-value]
        assert self.is_mixed, "only a mixed step has two parts"
        assert self.query_lens_host is not None and self.context_lens_host is not None
        rows = self.num_decode_rows
        query_lens, context_lens = self.query_lens_host, self.context_lens_host
        decode = AttentionMetadata(
            is_prefill=False,
            block_size=self.block_size,
            slot_mapping=self.slot_mapping[:rows],
            cu_seqlens_q=self.cu_seqlens_q[: rows + 1],
            cu_seqlens_k=self.cu_seqlens_k[: rows + 1],
            context_lens=self.context_lens[:rows],
            block_tables=self.block_tables[:rows],
            max_seqlen_q=1,
            max_seqlen_k=max(context_lens[:rows]),
            has_cached_prefix=True,
            has_padding_slots=self.has_padding_slots,
            query_lens_host=query_lens[:rows],
            context_lens_host=context_lens[:rows],
            num_decode_rows=rows,
        )
        prefill_q, prefill_k = query_lens[rows:], context_lens[rows:]
        prefill = AttentionMetadata(
            is_prefill=True,
            block_size=self.block_size,
            slot_mapping=self.slot_mapping[rows:],
            cu_seqlens_q=self.cu_seqlens_q[rows:] - rows,  # decode rows: one token each
            cu_seqlens_k=self.cu_seqlens_k[rows:] - self.cu_seqlens_k[rows],
            context_lens=self.context_lens[rows:],
            block_tables=self.block_tables[rows:],
            max_seqlen_q=max(prefill_q),
            max_seqlen_k=max(prefill_k),
            has_cached_prefix=any(k > q for q, k in zip(prefill_q, prefill_k, strict=True)),
            has_padding_slots=self.has_padding_slots,
            query_lens_host=prefill_q,
            context_lens_host=prefill_k,
        )
        self.derived["mixed_parts"] = (decode, prefill)
        return decode, prefill

    @classmethod
    def from_plan(cls, plan: BatchPlan, device: torch.device) -> AttentionMetadata:
        def ints(values: array[int], dtype: torch.dtype) -> torch.Tensor:
            return plan_tensor(values, dtype, device)

        if plan.block_table_width:
            block_tables = ints(plan.block_tables, torch.int32).view(-1, plan.block_table_width)
        else:  # no sequence holds a block: one filler column keeps the shape valid
            block_tables = torch.zeros((plan.num_seqs, 1), dtype=torch.int32, device=device)
        return cls(
            is_prefill=plan.is_prefill,
            block_size=plan.block_size,
            slot_mapping=ints(plan.slot_mapping, torch.int64),
            cu_seqlens_q=ints(plan.cu_seqlens_q, torch.int32),
            cu_seqlens_k=ints(plan.cu_seqlens_k, torch.int32),
            context_lens=ints(plan.context_lens, torch.int32),
            block_tables=block_tables,
            max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=plan.max_seqlen_k,
            has_cached_prefix=plan.has_cached_prefix,
            has_padding_slots=bool(plan.slot_mapping) and min(plan.slot_mapping) < 0,
            query_lens_host=plan.query_lens.tolist(),
            context_lens_host=plan.context_lens.tolist(),
            num_decode_rows=plan.num_decode_rows,
        )


class AttentionBackend(Protocol):
    """Stores a step's K/V into the paged cache and computes paged attention.

    Implementations: ``torch`` (reference, CPU and CUDA), ``triton`` (own kernels), ``flash``
    (flash-attn). A backend refuses block sizes it cannot serve at construction time with a
    :class:`~pagedinfer.errors.ConfigurationError`.
    """

    name: ClassVar[str]
    # True when forward() reads no host-side values, so decode can be captured in a CUDA graph.
    supports_cuda_graphs: ClassVar[bool]

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """Write ``key[t]`` / ``value[t]`` into slot ``slot_mapping[t]``; skip slots ``< 0``
        (quantized with ``kv_scales`` into a float8 cache)."""
        ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V, then attend; returns ``[T, num_heads, head_dim]``."""
        ...


@runtime_checkable
class AttendsStoredKV(Protocol):
    """A backend that can attend over K/V the caller already stored in the cache.

    The fused attention prologue (q/k norm + RoPE + KV store in one kernel) writes K/V into
    the paged cache itself; such backends then only attend (``triton``).
    """

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``query [T, heads, dim]`` over the cache; this step's K/V are in it."""
        ...
