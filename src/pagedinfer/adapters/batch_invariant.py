"""Batch-invariant execution: a row's result does not depend on what else shares its step.

A request's tokens and logprobs change with its batch when a reduction's split depends on
the batch: BLAS picks its blocking (and a matrix-vector kernel for one row) by the number of
rows, attention pads a batch to its longest context and splits it by the batch's lengths,
and a prompt's prefill is cut into chunks by the token budget others leave. With
``batch_invariant=True`` every reduction a row goes through has a split fixed in advance:

* **Linear layers and the LM head** (:func:`tiled_linear`): the rows are padded to a multiple
  of :data:`ROW_TILE` and multiplied as a batch of ``[ROW_TILE, in]`` tiles, so BLAS always
  sees the same shape whatever the number of rows (checked: a row's result is then the same
  in any tile, at any place). The skinny split-K GEMM is off. Quantized GEMMs run tile by
  tile.
* **Attention** (:class:`BatchInvariantAttention`): every row (decode or prefill) attends over
  its sequence's K/V read from the cache, in chunks of :data:`KV_CHUNK` keys from position 0,
  combined in order with an online softmax; query rows in tiles of :data:`ROW_TILE`. A
  chunk past a query's position is fully masked and leaves its sums exactly as they were, so
  the result depends neither on the other sequences, nor on how the prompt was chunked, nor
  on how far the step's longest query reaches. The backend's store kernel is kept.
* Norms, activations, RoPE and the sampler reduce along one row each (the same shape whatever
  the batch); seeded sampling draws per request already.

What it costs: the padding of the tiles, one attention call per sequence and chunk, and no
CUDA graphs (the attention reads host-side lengths); see docs/benchmarks.md. What it does not
cover: MoE models (the rows an expert gets depend on the batch; refused), and a change of
device, dtype, thread count or library version (bitwise equality holds within one setup).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedinfer.adapters.attention.base import AttentionMetadata, PagedAttentionBackend
from pagedinfer.adapters.attention.torch_ref import fp8_scales
from pagedinfer.adapters.kv_cache import dequantize_fp8

__all__ = [
    "KV_CHUNK",
    "ROW_TILE",
    "BatchInvariantAttention",
    "attend_group",
    "invariant_attention",
    "make_batch_invariant",
    "tiled_linear",
]

ROW_TILE = 16
"""Rows per GEMM tile (linear layers, attention queries)."""
KV_CHUNK = 64
"""Keys per attention chunk (the fixed split of the softmax and of ``P @ V``)."""


def _pad_rows(x: torch.Tensor, tile: int) -> torch.Tensor:
    pad = -x.shape[0] % tile
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) if pad else x


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` computed as ``[ROW_TILE, in]`` tiles: each row's result is the
    same whatever the number of rows."""
    flat = x.reshape(-1, x.shape[-1])
    padded = _pad_rows(flat, ROW_TILE)
    tiles = padded.view(-1, ROW_TILE, padded.shape[-1])
    out = torch.matmul(tiles, weight.t()).view(-1, weight.shape[0])[: flat.shape[0]]
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def in_row_tiles(x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``run`` over ``[ROW_TILE, ...]`` tiles of ``x`` (for GEMMs that take a 2-D input only)."""
    rows = x.shape[0]
    padded = _pad_rows(x, ROW_TILE)
    outs = [run(padded[start : start + ROW_TILE]) for start in range(0, padded.shape[0], ROW_TILE)]
    return torch.cat(outs)[:rows]


def make_batch_invariant(model: nn.Module) -> None:
    """Switch ``model``'s linear layers and LM head to :func:`tiled_linear` (and the skinny
    GEMM off); its attention layers get :class:`BatchInvariantAttention` over their backend."""
    from pagedinfer.adapters.layers.attention import PagedAttention
    from pagedinfer.adapters.layers.embedding import ParallelLMHead
    from pagedinfer.adapters.layers.linear import LinearBase

    wrapped: dict[int, BatchInvariantAttention] = {}
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            module.batch_invariant = True
        elif isinstance(module, PagedAttention):
            backend = module.backend
            if not isinstance(backend, BatchInvariantAttention):
                assert isinstance(backend, PagedAttentionBackend), backend
                if id(backend) not in wrapped:
                    wrapped[id(backend)] = BatchInvariantAttention(backend)
                module.backend = wrapped[id(backend)]


class BatchInvariantAttention(PagedAttentionBackend):
    """Stores with ``inner``'s kernel; attends with :func:`invariant_attention`."""

    name: ClassVar[str] = "batch_invariant"
    supports_cuda_graphs: ClassVar[bool] = False  # reads host-side lengths

    def __init__(self, inner: PagedAttentionBackend) -> None:
        super().__init__(inner.block_size)
        self.inner = inner

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
        """Attention over K/V the caller stored already (the fused RoPE-and-store path)."""
        return invariant_attention(
            query, k_cache, v_cache, meta, scale, kv_scales, window, sinks, softcap
        )

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
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return invariant_attention(
            query, k_cache, v_cache, meta, scale, kv_scales, window, sinks, softcap
        )

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
        self.inner._store(key, value, k_cache, v_cache, slot_mapping, has_padding_slots, kv_scales)

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
        raise AssertionError("batch-invariant attention has one path (_attend)")

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
        raise AssertionError("batch-invariant attention has one path (_attend)")


def invariant_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: torch.Tensor | None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Every row of the step over its sequence's cached K/V (this step's included), with the
    fixed splits of the module docstring. ``query [T, H, D]``; ``window``: a sliding window
    (keys ``p - window < n <= p``); ``sinks [H]``: one logit per head in the denominator;
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the masks.

    Sequences with as many query tiles are computed together (decode rows: one tile each),
    each one's keys padded to the group's most key chunks. A padded key chunk is fully masked
    for the sequence's queries, which leaves their sums exactly as they were, so a row's
    result is the one it gets alone: every GEMM it takes part in is one
    ``[ROW_TILE, D] x [D, KV_CHUNK]`` or ``[ROW_TILE, KV_CHUNK] x [KV_CHUNK, D]`` product of
    its own tile and chunk. Chunks wholly left of every window in the group are skipped (for
    the same reason they change nothing); a sink joins as a key of value zero before the
    first chunk.
    """
    query_lens, context_lens = _host_lengths(meta)
    first_rows = list(itertools.accumulate(query_lens, initial=0))
    groups: dict[int, list[int]] = {}
    for seq, count in enumerate(query_lens):
        groups.setdefault(-(-count // ROW_TILE), []).append(seq)
    out = torch.empty_like(query)
    for seqs in groups.values():
        rows = [first_rows[seq] + i for seq in seqs for i in range(query_lens[seq])]
        index = torch.tensor(rows, dtype=torch.int64, device=query.device)
        out[index] = attend_group(
            query[index],
            (k_cache, v_cache, kv_scales),
            meta.block_tables[torch.tensor(seqs, device=query.device)],
            [query_lens[seq] for seq in seqs],
            [context_lens[seq] for seq in seqs],
            scale,
            window,
            sinks,
            softcap,
        )
    return out


def _host_lengths(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """The step's query and context lengths on the host: the packer's lists, or (when it
    gave none, as on CUDA) read from the device once per step and kept in ``meta.derived``
    for every other layer."""
    cached = meta.derived.get("batch_invariant.host_lengths")
    if cached is not None:
        return cast(tuple[list[int], list[int]], cached)
    query_lens = meta.query_lens_host
    if query_lens is None:
        starts = meta.cu_seqlens_q.tolist()
        query_lens = [end - start for start, end in itertools.pairwise(starts)]
    context_lens = meta.context_lens_host
    if context_lens is None:
        context_lens = meta.context_lens.tolist()
    meta.derived["batch_invariant.host_lengths"] = (query_lens, context_lens)
    return query_lens, context_lens


def attend_group(
    query: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    block_tables: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`invariant_attention` of one group: its sequences' rows, in order."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    device = query.device
    num_seqs = len(query_lens)
    tile_rows = -(-max(query_lens) // ROW_TILE) * ROW_TILE
    num_keys = -(-max(context_lens) // KV_CHUNK) * KV_CHUNK
    # The first key any query of sequence s sees (0 without a window).
    lowest = [
        0 if window is None else max(0, length - count - window + 1)
        for count, length in zip(query_lens, context_lens, strict=True)
    ]
    # Where each query row goes in the padded [num_seqs * tile_rows] rows, and its position.
    destinations: list[int] = []
    positions: list[int] = []
    for row, (count, length) in enumerate(zip(query_lens, context_lens, strict=True)):
        destinations += range(row * tile_rows, row * tile_rows + count)
        positions += range(length - count, length)
    where = torch.tensor(destinations, dtype=torch.int64, device=device)
    padded_positions = torch.zeros(num_seqs * tile_rows, dtype=torch.int64, device=device)
    padded_positions[where] = torch.tensor(positions, dtype=torch.int64, device=device)
    queries = query.new_zeros((num_seqs * tile_rows, num_heads, head_dim))
    queries[where] = query
    # [seqs, tiles, H, ROW_TILE, D] and the positions [seqs, tiles, 1, ROW_TILE, 1].
    queries = queries.view(num_seqs, -1, ROW_TILE, num_heads, head_dim).transpose(2, 3)
    queries = queries.float().contiguous()  # once, not in every chunk's matmul
    padded_positions = padded_positions.view(num_seqs, -1, 1, ROW_TILE, 1)
    keys, values = _gather_padded(cache, block_tables, lowest, context_lens, num_keys)
    group = num_heads // keys.shape[2]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=2)
        values = values.repeat_interleave(group, dim=2)
    shape = (*queries.shape[:-1],)  # [seqs, tiles, H, ROW_TILE]
    if sinks is None:
        running_max = torch.full(shape, float("-inf"), dtype=torch.float32, device=device)
        total = torch.zeros(shape, dtype=torch.float32, device=device)
    else:  # a key of logit sinks[h] and value zero, first
        running_max = sinks.float()[None, None, :, None].expand(shape).clone()
        total = torch.ones(shape, dtype=torch.float32, device=device)
    acc = torch.zeros((*shape, head_dim), dtype=torch.float32, device=device)
    offsets = torch.arange(KV_CHUNK, device=device)
    for chunk in range(min(lowest) // KV_CHUNK, num_keys // KV_CHUNK):
        window_keys = slice(chunk * KV_CHUNK, (chunk + 1) * KV_CHUNK)
        k = keys[:, window_keys].permute(0, 2, 3, 1)[:, None]  # [seqs, 1, H, D, C]
        v = values[:, window_keys].permute(0, 2, 1, 3)[:, None]  # [seqs, 1, H, C, D]
        scores = torch.matmul(queries, k) * scale  # [seqs, tiles, H, ROW_TILE, C]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        key_positions = chunk * KV_CHUNK + offsets
        masked = key_positions > padded_positions
        if window is not None:
            masked = masked | (key_positions <= padded_positions - window)
        scores = scores.masked_fill(masked, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1))
        base = torch.where(new_max == float("-inf"), 0.0, new_max)
        weights = torch.exp(scores - base[..., None])
        rescale = torch.exp(running_max - base)
        total = total * rescale + weights.sum(-1)
        acc = acc * rescale[..., None] + torch.matmul(weights, v)
        running_max = new_max
    result = (acc / total[..., None]).transpose(2, 3).reshape(-1, num_heads, head_dim)
    return result[where].to(query.dtype)


def _gather_padded(
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    block_tables: torch.Tensor,
    lowest: list[int],
    context_lens: list[int],
    num_keys: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's first ``num_keys`` cached K and V ``[seqs, num_keys, Hk, D]`` as
    float32. Outside ``[lowest, length)`` (pages a window left behind, whose table entries
    may name any block, and the padding past the length): copies of a key inside it, masked
    for all the sequence's queries."""
    k_cache, v_cache, kv_scales = cache
    device = k_cache.device
    block_size = k_cache.shape[1]
    lengths = torch.tensor(context_lens, dtype=torch.int64, device=device)
    low = torch.tensor(lowest, dtype=torch.int64, device=device)
    positions = torch.arange(num_keys, device=device)[None, :]
    positions = torch.minimum(torch.maximum(positions, low[:, None]), lengths[:, None] - 1)
    tables = block_tables.long()
    slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    scales = fp8_scales(k_cache, kv_scales)
    keys = _readable(flat_k[slots], scales, 0)
    values = _readable(flat_v[slots], scales, 1)
    return keys, values


def _readable(stored: torch.Tensor, scales: torch.Tensor | None, index: int) -> torch.Tensor:
    if scales is None:
        return stored.float()
    return dequantize_fp8(stored, scales[index], torch.float32)
