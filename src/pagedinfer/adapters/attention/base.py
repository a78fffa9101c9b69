"""The attention-backend contract and the per-step metadata every backend reads.

There is no global "context": the model runner builds one :class:`AttentionMetadata` per step
from the :class:`~pagedinfer.domain.BatchPlan` (in one place, the packer of
:mod:`pagedinfer.adapters.step_inputs`; :func:`~pagedinfer.adapters.step_inputs.plan_metadata`
gives a plan's metadata alone) and passes it down through the model's ``forward`` explicitly.

Shapes (``T`` query tokens this step, ``B`` sequences, ``W`` block-table width):

* query ``[T, num_heads, head_dim]``, key / value ``[T, num_kv_heads, head_dim]``
* one layer's cache ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``
* output ``[T, num_heads, head_dim]``
* ``kv_scales`` (FP8 caches only): the layer's float32 scale row ``[k_scale, v_scale,
  1 / k_scale, 1 / v_scale]`` (see :mod:`pagedinfer.adapters.kv_cache`); a backend knows the
  cache is FP8 from its dtype. ``None`` with a float8 cache means scales of 1.0.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import torch

__all__ = [
    "AttendsStoredKV",
    "AttentionBackend",
    "AttentionMetadata",
    "LayerAttentionKind",
    "PagedAttentionBackend",
]


@dataclass(frozen=True, slots=True)
class LayerAttentionKind:
    """How one attention layer attends: what a model tells its layers and the KV manager.

    ``window``: a sliding window of that many positions; the query at position ``p`` sees
    keys ``p - window < n <= p`` (transformers' rule: the most recent ``window`` positions,
    itself included); ``None``: full causal attention. ``has_sinks``: the layer adds one
    learned logit per head to its softmax's denominator (GPT-OSS). ``softcap``: the layer caps
    its attention scores, ``softcap * tanh(scores / softcap)`` after the scale and before the
    masks (Gemma 2's ``attn_logit_softcapping``); ``None``: uncapped.

    A step's K/V needed by a sliding layer: sequence ``s``'s first query sits at position
    ``context_lens[s] - query_lens[s]``, so it reads keys from ``that - window + 1`` on;
    pages wholly left of that are never read by any backend (a KV manager may free them and
    leave any block id in their table entries).
    """

    window: int | None = None
    has_sinks: bool = False
    softcap: float | None = None

    def __post_init__(self) -> None:
        assert self.window is None or self.window >= 1, self.window
        assert self.softcap is None or self.softcap > 0.0, self.softcap

    @property
    def is_sliding(self) -> bool:
        return self.window is not None


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
    # Hybrid attention: the block tables and slots of KV groups 1, 2, ... (BatchPlan's
    # group_block_tables / group_slot_mappings); block_tables / slot_mapping are group 0's.
    group_block_tables: tuple[torch.Tensor, ...] = ()
    group_slot_mappings: tuple[torch.Tensor, ...] = ()

    def for_group(self, group: int) -> AttentionMetadata:
        """This step's metadata as the layers of KV group ``group`` see it: that group's
        block tables and slots (made once per step and group, so every layer of the group
        shares what backends derive from it). Group 0, or a step without group tables (the
        warm-up and calibration passes): this metadata itself."""
        if group == 0 or not self.group_block_tables:
            return self
        key = f"kv_group_{group}"
        cached = self.derived.get(key)
        if cached is None:
            tables = self.group_block_tables[group - 1]
            slots = self.group_slot_mappings[group - 1]
            cached = dataclasses.replace(
                self,
                block_tables=tables,
                slot_mapping=slots,
                derived={},
                group_block_tables=(),
                group_slot_mappings=(),
            )
            if self.is_mixed:  # group 0's parts with this group's tables (no device ops)
                rows = self.num_decode_rows
                decode, prefill = self.split_mixed()
                cached.derived["mixed_parts"] = (
                    dataclasses.replace(
                        decode, block_tables=tables[:rows], slot_mapping=slots[:rows], derived={}
                    ),
                    dataclasses.replace(
                        prefill, block_tables=tables[rows:], slot_mapping=slots[rows:], derived={}
                    ),
                )
            self.derived[key] = cached
        assert isinstance(cached, AttentionMetadata)
        return cached

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
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V, then attend; returns ``[T, num_heads, head_dim]``.

        ``window``: the layer's sliding window (see :class:`LayerAttentionKind`); ``sinks``:
        its per-head sink logits ``[num_heads]`` (float32), when it has them; ``softcap``:
        its attention-logit cap (``None`` or 0: uncapped)."""
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
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of ``query [T, heads, dim]`` over the cache; this step's K/V are in it."""
        ...


class PagedAttentionBackend(ABC):
    """What every backend shares: the public store / forward wrappers and the dispatch of a
    step to the kernels. A backend implements three hooks, :meth:`_store`, :meth:`_prefill`
    and :meth:`_decode`, and nothing else about the step's shape.

    Dispatch (:meth:`_attend`): a prefill step goes to ``_prefill``, a decode step to
    ``_decode``; a mixed step (decode rows first, then prefill chunks) is split with
    :meth:`AttentionMetadata.split_mixed` and each part goes to its kernel, writing its rows of
    one output (``split_mixed_steps``, the default). With ``split_mixed_steps=False`` the
    prefill kernel serves every row (a decode row is a one-token chunk with a cached prefix).
    """

    name: ClassVar[str]
    # True when forward() reads no host-side values, so decode can be captured in a CUDA graph.
    supports_cuda_graphs: ClassVar[bool]
    # False when the backend cannot add attention sinks (layers with them are refused).
    supports_sinks: ClassVar[bool] = True
    # False when the backend cannot cap attention logits (layers with a softcap are refused).
    supports_softcap: bool = True

    def __init__(self, block_size: int, *, split_mixed_steps: bool = True) -> None:
        self.block_size = block_size
        self.split_mixed_steps = split_mixed_steps

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
        self._store(key, value, k_cache, v_cache, slot_mapping, True, kv_scales)

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
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V, then attend; returns ``[T, num_heads, head_dim]``.

        ``window``: the layer's sliding window (see :class:`LayerAttentionKind`); ``sinks``:
        its per-head sink logits ``[num_heads]`` (float32), when it has them; ``softcap``:
        its attention-logit cap (``None`` or 0: uncapped)."""
        self._store(
            key, value, k_cache, v_cache, meta.slot_mapping, meta.has_padding_slots, kv_scales
        )
        return self._attend(
            query, key, value, k_cache, v_cache, meta, scale, kv_scales,
            window=window, sinks=sinks, softcap=softcap,
        )  # fmt: skip

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of the step's queries over the cache, which holds this step's K/V;
        ``key`` / ``value`` are this step's own (``None`` when the caller stored them itself:
        a backend that needs them must not be used that way)."""
        scales = self._scales(k_cache, kv_scales)
        if meta.is_mixed and self.split_mixed_steps:
            decode, prefill = meta.split_mixed()
            rows = meta.num_decode_rows  # = decode tokens
            out = torch.empty_like(query)
            self._decode(
                query[:rows], k_cache, v_cache, decode, scale, scales, out[:rows],
                window=window, sinks=sinks, softcap=softcap,
            )  # fmt: skip
            self._prefill(
                query[rows:],
                None if key is None else key[rows:],
                None if value is None else value[rows:],
                k_cache,
                v_cache,
                prefill,
                scale,
                scales,
                out[rows:],
                window=window,
                sinks=sinks,
                softcap=softcap,
            )
            return out
        if meta.is_prefill:
            return self._prefill(
                query, key, value, k_cache, v_cache, meta, scale, scales, None,
                window=window, sinks=sinks, softcap=softcap,
            )  # fmt: skip
        return self._decode(
            query,
            k_cache,
            v_cache,
            meta,
            scale,
            scales,
            None,
            window=window,
            sinks=sinks,
            softcap=softcap,
        )

    def _scales(self, k_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> torch.Tensor | None:
        """The scale row the kernels get (the layer's, by default)."""
        return kv_scales

    # ------------------------------------------------------------------ the kernels
    @abstractmethod
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
        """The store kernel (``has_padding_slots``: some slots may be ``< 0``)."""

    @abstractmethod
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
        """The prefill kernel over a prefill step (or part): into ``out`` when given (and
        returned), else into a new tensor. ``window`` / ``sinks`` / ``softcap``: see
        :meth:`forward`."""

    @abstractmethod
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
        """The decode kernel over a decode step (or part), one query token per sequence:
        into ``out`` when given (and returned), else into a new tensor. ``window`` /
        ``sinks`` / ``softcap``: see :meth:`forward`."""
