"""The reference backend: gather pages, call ``scaled_dot_product_attention``.

Runs on CPU and CUDA and is the oracle the Triton and flash backends are tested against.
It is also the production backend on CPU, so the common cases avoid needless work: a
prefill with no cached prefix attends over the step's own K/V without touching the cache,
and decode is a few batched SDPA calls over the gathered pages. A mixed step runs its decode
rows through the decode path and its prefill chunks through the prefill path.

Decode pads every sequence of a batch to the longest context, so a batch of very different
lengths would gather and attend over mostly padding. The batch is therefore split into a few
groups of similar length (sorted by context length, equal-count groups; the number of groups
that minimises padded rows plus a fixed per-call cost wins), and groups are cut further so
that none gathers more than a few MB of K/V: on the CPU a batch's whole gathered context
spills the caches, and attention over it runs several times slower than in cache-sized
pieces (128 rows of 1-2k tokens: 2.2x). The grouping, the flat slot ids and the masks are
derived once per step (per sliding window) and reused by every layer.

Sliding windows and sinks: a layer with a window attends, in decode, over the last
``window`` keys of each context only (gathered from the window's first key, so pages left of
it are never read), and in prefill over the keys from its first query's window on, masked by
position. Sinks (one logit per head in the softmax's denominator) go through
:func:`attention_with_sinks`, a float32 softmax like transformers'; so do layers with capped
attention logits (``softcap``: ``cap * tanh(scores / cap)`` before the mask, Gemma 2).

FP8 KV cache (a float8 cache tensor, with the layer's scale row ``kv_scales``, see
:mod:`pagedinfer.adapters.kv_cache`): the store quantizes (:func:`~pagedinfer.adapters.kv_cache.
quantize_fp8`), every read dequantizes into the query's dtype. A prefill with no cached prefix
attends over its own K/V quantized and dequantized in place, exactly what a later step reads
back from the cache: a prompt's logits are then the same whether its prefix came from the
prefix cache or not (and the same as the Triton kernels', which read every key from the cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from pagedinfer.adapters.attention.base import AttentionMetadata, PagedAttentionBackend
from pagedinfer.adapters.kv_cache import dequantize_fp8, is_fp8, quantize_fp8, unit_scales

__all__ = [
    "TorchAttentionBackend",
    "attention_with_sinks",
    "fp8_scales",
    "gather_context",
    "split_by_length",
    "store_kv_torch",
    "window_start",
]

# A decode group costs a few extra small ops (row selects, one more SDPA call, a scatter):
# about as much as gathering and attending over this many bytes of K+V. Measured on CPU.
_GROUP_OVERHEAD_BYTES = 512 * 1024
_MAX_DECODE_GROUPS = 4
# A group's gathered K and V stay within this many bytes (more groups if need be): on the CPU,
# gathering a large batch's whole context at once spills the caches, and attention over it is
# then bound by memory (several times slower than attending in cache-sized pieces).
_GROUP_GATHER_BYTES = 4 * 1024 * 1024


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    has_padding_slots: bool = True,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write each token's K/V to its slot; slots ``< 0`` are skipped. A float8 cache stores
    ``quantize_fp8`` of them with the scale row ``kv_scales`` (1.0 when ``None``)."""
    num_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    flat_k = k_cache.view(-1, num_heads, head_dim)
    flat_v = v_cache.view(-1, num_heads, head_dim)
    if has_padding_slots:
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    scales = fp8_scales(k_cache, kv_scales)
    if scales is None:
        flat_k.index_copy_(0, slot_mapping, _as(key, flat_k.dtype))
        flat_v.index_copy_(0, slot_mapping, _as(value, flat_v.dtype))
        return
    # torch has no index_copy_ for float8: copy the bytes.
    stored_k = quantize_fp8(key, scales[2], flat_k.dtype).view(torch.uint8)
    stored_v = quantize_fp8(value, scales[3], flat_v.dtype).view(torch.uint8)
    flat_k.view(torch.uint8).index_copy_(0, slot_mapping, stored_k)
    flat_v.view(torch.uint8).index_copy_(0, slot_mapping, stored_v)


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)`` without a dispatch when it has that dtype (the common case: a
    decode step would pay for 4 no-op calls per layer)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def fp8_scales(cache: torch.Tensor, kv_scales: torch.Tensor | None) -> torch.Tensor | None:
    """The scale row to use with ``cache``: ``None`` for a cache in a model dtype, else
    ``kv_scales`` (unit scales when not given)."""
    if not is_fp8(cache.dtype):
        return None
    return kv_scales if kv_scales is not None else unit_scales(cache.device)


def _readable(
    stored: torch.Tensor, scales: torch.Tensor | None, index: int, dtype: torch.dtype
) -> torch.Tensor:
    """Cache contents as ``dtype`` values (dequantized with ``scales[index]`` when FP8)."""
    if scales is None:
        return _as(stored, dtype)
    return dequantize_fp8(stored, scales[index], dtype)


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, start: int = 0
) -> torch.Tensor:
    """Tokens ``start .. length - 1`` of one sequence's pages: ``[length - start, kv_heads,
    head_dim]``; pages wholly before ``start`` are not read."""
    block_size = cache.shape[1]
    first, num_blocks = start // block_size, -(-length // block_size)
    pages = cache.index_select(0, block_table[first:num_blocks].long())
    offset = start - first * block_size
    return pages.flatten(0, 1)[offset : offset + length - start]


def window_start(position: int, window: int | None) -> int:
    """The first key a query at ``position`` sees (0 without a window)."""
    return 0 if window is None else max(0, position - window + 1)


def attention_with_sinks(
    query: torch.Tensor,  # [..., heads, q, dim]
    key: torch.Tensor,  # [..., kv_heads, k, dim]
    value: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,  # [heads] float32 logits
    visible: torch.Tensor | None = None,  # bool, broadcastable to [..., heads, q, k]
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention with one extra logit per head in the denominator and no value
    (GPT-OSS's sinks, computed as transformers does: the sink joins the scores' softmax and
    is dropped after it), in float32. ``softcap``: the scores become ``softcap *
    tanh(scores / softcap)`` after the scale, before the mask (transformers' eager
    attention, Gemma 2); the path of every layer with a cap, with or without sinks."""
    group = query.shape[-3] // key.shape[-3]
    if group > 1:
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scores = query.float() @ key.float().transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.float()[:, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return (probs @ value.float()).to(query.dtype)


def split_by_length(
    lengths: list[int], overhead: int, max_groups: int = _MAX_DECODE_GROUPS
) -> list[list[int]] | None:
    """Rows grouped by similar length to cut padding; ``None`` when one group is best.

    Candidates are ``1..max_groups`` equal-count groups of the rows sorted by length; a
    candidate costs the padded rows it processes (``group size * longest in group``) plus
    ``overhead`` rows per group.
    """
    count = len(lengths)
    order = sorted(range(count), key=lengths.__getitem__)
    best_cost = count * max(lengths, default=0) + overhead
    best: list[list[int]] | None = None
    for num_groups in range(2, min(max_groups, count) + 1):
        bounds = [count * g // num_groups for g in range(num_groups + 1)]
        groups = [order[bounds[g] : bounds[g + 1]] for g in range(num_groups)]
        cost = sum(len(rows) * lengths[rows[-1]] for rows in groups) + num_groups * overhead
        if cost < best_cost:
            best_cost, best = cost, groups
    return best


@dataclass(frozen=True, slots=True)
class _DecodeGroup:
    """Sequences decoded by one SDPA call, padded to the group's longest context."""

    rows: torch.Tensor | None  # batch rows in this group; None: the whole batch, in order
    slots: torch.Tensor  # [n * longest] flat cache slot of each padded position
    # [n, 1, 1, longest] True where the position is in the context; None: no padding (every
    # sequence of the group is `longest` long), so SDPA needs no mask.
    mask: torch.Tensor | None
    num_seqs: int
    longest: int
    # One sequence whose context lies in consecutive cache slots (its blocks are adjacent):
    # the first of them. Its K/V are then a view of the cache, not a gathered copy.
    first_slot: int | None = None


def _build_decode_group(
    meta: AttentionMetadata,
    rows: list[int] | None,
    lengths: list[int] | None,
    window: int | None = None,
) -> _DecodeGroup:
    """The group of ``rows`` (``None``: every row); ``lengths``: the keys each row attends to
    (its context, or its window's part of it), on the host when known."""
    device = meta.context_lens.device
    row_index = None if rows is None else torch.tensor(rows, device=device)
    tables = meta.block_tables if row_index is None else meta.block_tables[row_index]
    context_lens = meta.context_lens if row_index is None else meta.context_lens[row_index]
    # A sliding window: row s attends to its last `window` keys, from key_starts[s] on.
    key_starts = None
    if window is not None:
        key_starts = (context_lens.long() - window).clamp(min=0)
        context_lens = context_lens.long() - key_starts
    group_lengths = None
    if lengths is not None:
        group_lengths = lengths if rows is None else [lengths[row] for row in rows]
        longest = max(group_lengths)
    else:
        longest = int(context_lens.max().item())
    num_seqs = int(tables.shape[0])
    positions = torch.arange(longest, device=device)
    if key_starts is None:
        slots = tables.long()[:, positions // meta.block_size] * meta.block_size
        slots += positions % meta.block_size
    else:
        # Padding positions of a short row stay inside its table (start 0, < longest).
        absolute = key_starts[:, None] + positions[None, :]
        pages = tables.long().gather(1, absolute // meta.block_size)
        slots = pages * meta.block_size + absolute % meta.block_size
    mask = None
    if group_lengths is None or min(group_lengths) < longest:  # padded rows: mask them
        mask = (positions[None, :] < context_lens[:, None].to(positions.dtype))[:, None, None, :]
    first_slot = None
    if num_seqs == 1 and key_starts is None:
        first_slot = _contiguous_context(tables, longest, meta.block_size)
    return _DecodeGroup(
        rows=row_index,
        slots=slots.view(-1),
        mask=mask,
        num_seqs=num_seqs,
        longest=longest,
        first_slot=first_slot,
    )


def _contiguous_context(tables: torch.Tensor, length: int, block_size: int) -> int | None:
    """The first cache slot of a single sequence's first ``length`` tokens when its blocks
    holding them are adjacent in the cache (block ``b``, ``b + 1``, ...), else ``None``.
    Reads the block table on the host: CPU tensors only."""
    if tables.device.type != "cpu":
        return None
    num_blocks = -(-length // block_size)
    blocks = tables[0, :num_blocks].tolist()
    first = blocks[0]
    if blocks != list(range(first, first + num_blocks)):
        return None
    return int(first) * block_size


def _decode_groups(
    meta: AttentionMetadata, row_bytes: int, window: int | None = None
) -> list[_DecodeGroup]:
    """This step's decode groups for layers with ``window``, derived on first use and kept
    in ``meta.derived``."""
    derived_key = "torch.decode_groups" if window is None else f"torch.decode_groups.{window}"
    cached = meta.derived.get(derived_key)
    if cached is not None:
        return cached  # type: ignore[return-value]
    lengths = meta.context_lens_host
    if lengths is not None and window is not None:
        lengths = [min(length, window) for length in lengths]
    split = None
    if lengths:
        split = split_by_length(lengths, overhead=max(1, _GROUP_OVERHEAD_BYTES // row_bytes))
    if lengths:
        parts = split if split is not None else [list(range(len(lengths)))]
        split = _bounded(parts, lengths, max(1, _GROUP_GATHER_BYTES // row_bytes))
    if split is None:
        groups = [_build_decode_group(meta, None, lengths, window)]
    else:
        groups = [_build_decode_group(meta, rows, lengths, window) for rows in split]
    meta.derived[derived_key] = groups
    return groups


def _bounded(
    groups: list[list[int]], lengths: list[int], max_tokens: int
) -> list[list[int]] | None:
    """``groups`` cut so that no group gathers more than ``max_tokens`` padded K/V rows;
    ``None`` when that leaves one group of every row in order (nothing to select)."""
    bounded: list[list[int]] = []
    for rows in groups:
        longest = max(lengths[row] for row in rows)
        per_call = max(1, max_tokens // longest)
        bounded.extend(rows[i : i + per_call] for i in range(0, len(rows), per_call))
    if len(bounded) == 1 and bounded[0] == list(range(len(lengths))):
        return None
    return bounded


def _sdpa(
    query: torch.Tensor,  # [batch, heads, q, dim] or [heads, q, dim]
    key: torch.Tensor,  # [batch, kv_heads, k, dim] or [kv_heads, k, dim]
    value: torch.Tensor,
    scale: float,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA with a batch dimension always present.

    On CPU, 3-D inputs take the slow "math" path (it materialises the scores and a causal
    mask); 4-D inputs take the fused flash kernel, several times faster.
    """
    unbatched = query.dim() == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=query.shape[-3] != key.shape[-3],
    )
    return out[0] if unbatched else out


class TorchAttentionBackend(PagedAttentionBackend):
    """Paged attention with plain torch ops; any block size.

    A mixed step (decode rows, then prefill chunks) is split into its decode part, which takes
    the batched decode path, and its prefill part (``split_mixed_steps``, the default);
    ``split_mixed_steps=False`` runs every row through the prefill path instead (a decode row
    is then a one-token chunk with a cached prefix: one gather and SDPA call per row).
    """

    name: ClassVar[str] = "torch"
    supports_cuda_graphs: ClassVar[bool] = False

    def _scales(self, k_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> torch.Tensor | None:
        """``None`` for a cache in a model dtype, else the row (unit scales when not given)."""
        return fp8_scales(k_cache, kv_scales)

    # ------------------------------------------------------------------ the kernels
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
        store_kv_torch(
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            has_padding_slots=has_padding_slots,
            kv_scales=kv_scales,
        )

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
        assert key is not None and value is not None, "the torch prefill reads the step's K/V"
        scales = kv_scales
        query_lens = _host(meta.query_lens_host, meta.cu_seqlens_q.diff())
        context_lens = _host(meta.context_lens_host, meta.context_lens)
        output = torch.empty_like(query) if out is None else out
        if scales is not None:  # attend to what the cache holds: the K/V as stored
            dtype = k_cache.dtype
            key = dequantize_fp8(quantize_fp8(key, scales[2], dtype), scales[0], query.dtype)
            value = dequantize_fp8(quantize_fp8(value, scales[3], dtype), scales[1], query.dtype)
        start = 0
        for index, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens, strict=True)):
            end = start + q_len
            q = query[start:end].transpose(0, 1)
            # Keys lo .. ctx_len - 1: what the first query's window reaches (0 without one).
            lo = window_start(ctx_len - q_len, window)
            if ctx_len == q_len:  # nothing cached: this step's own K/V are the whole context
                k = key[start + lo : end].transpose(0, 1)
                v = value[start + lo : end].transpose(0, 1)
            else:
                table = meta.block_tables[index]
                k = _readable(gather_context(k_cache, table, ctx_len, lo), scales, 0, q.dtype)
                v = _readable(gather_context(v_cache, table, ctx_len, lo), scales, 1, q.dtype)
                k, v = k.transpose(0, 1), v.transpose(0, 1)
            if ctx_len == q_len and window is None and sinks is None and not softcap:
                attended = _sdpa(q, k, v, scale, is_causal=True)
            else:
                # Query i sits at position ctx_len - q_len + i and sees keys up to there
                # (and, with a window, none at or before that - window).
                rows = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
                keys = torch.arange(lo, ctx_len, device=query.device)[None, :]
                mask = keys <= rows[:, None]
                if window is not None:
                    mask &= keys > rows[:, None] - window
                if sinks is not None or softcap:
                    attended = attention_with_sinks(q, k, v, scale, sinks, mask, softcap)
                else:
                    attended = _sdpa(q, k, v, scale, attn_mask=mask)
            output[start:end] = attended.transpose(0, 1)
            start = end
        return output

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
        scales = kv_scales  # fp8_scales' row (see _scales)
        num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
        row_bytes = 2 * num_kv_heads * head_dim * k_cache.element_size()
        groups = _decode_groups(meta, row_bytes, window)
        if len(groups) == 1:
            result = self._decode_group(
                query, k_cache, v_cache, groups[0], scale, scales, sinks, softcap
            )
            if out is None:
                return result
            out.copy_(result)
            return out
        output = torch.empty_like(query) if out is None else out
        for group in groups:
            assert group.rows is not None  # only a single group covers the batch in order
            part = self._decode_group(
                query[group.rows], k_cache, v_cache, group, scale, scales, sinks, softcap
            )
            output.index_copy_(0, group.rows, part)
        return output

    @staticmethod
    def _decode_group(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: _DecodeGroup,
        scale: float,
        scales: torch.Tensor | None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        # Gather `longest` slots of each sequence from its first key on (not whole pages): one
        # index_select per cache over flat slot ids, [n, longest] -> [n, longest, kv_heads, dim].
        # A single sequence in adjacent blocks attends over a view of the cache instead.
        num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
        shape = (group.num_seqs, group.longest, num_kv_heads, head_dim)
        flat_k = k_cache.view(-1, num_kv_heads * head_dim)
        flat_v = v_cache.view(-1, num_kv_heads * head_dim)
        if group.first_slot is not None:
            k = flat_k.narrow(0, group.first_slot, group.longest).view(shape)
            v = flat_v.narrow(0, group.first_slot, group.longest).view(shape)
        else:
            k = flat_k.index_select(0, group.slots).view(shape)
            v = flat_v.index_select(0, group.slots).view(shape)
        q = query.view(group.num_seqs, -1, 1, head_dim)
        k = _readable(k, scales, 0, query.dtype).transpose(1, 2)
        v = _readable(v, scales, 1, query.dtype).transpose(1, 2)
        if sinks is not None or softcap:
            out = attention_with_sinks(q, k, v, scale, sinks, group.mask, softcap)
        else:
            out = _sdpa(q, k, v, scale, attn_mask=group.mask)
        return out.view(group.num_seqs, -1, head_dim)


def _host(values: list[int] | None, tensor: torch.Tensor) -> list[int]:
    return values if values is not None else [int(x) for x in tensor.tolist()]
