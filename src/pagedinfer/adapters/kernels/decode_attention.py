"""Decode attention over the paged cache: one query per sequence, GQA-grouped, split-KV.

GQA grouping: program ``(s, g, p)`` handles *all* ``G = num_heads / num_kv_heads`` query heads
that share kv head ``g`` of sequence ``s``. Their queries form the rows of one ``[BLOCK_G, D]``
tile (``BLOCK_G`` = ``G`` padded to >= 16 for ``tl.dot``; padding rows are zeros and never
stored), so each K/V tile is loaded from memory once per group instead of once per head.

Split-KV: with few sequences (small batches, long contexts) one program per (sequence, kv
head) leaves most SMs idle, so the context is cut into ``num_splits`` partitions processed by
separate programs. Sequence ``s`` with ``ctx_len`` tokens gives each partition
``split_len = roundup(cdiv(ctx_len, num_splits), BLOCK_N)`` keys: partition ``p`` covers
``[p * split_len, min((p + 1) * split_len, ctx_len))``, computed on the device. Each program
runs the online softmax (see :mod:`.paged_tile`) over its partition and writes its partial
state — row maximum, row sum and unnormalised output — to a float32 workspace; a partition
that starts past the context (a short sequence in a long-context batch) skips the loop and
writes the neutral state ``(-inf, 0, 0)``. A second, small kernel, grid
``(num_seqs, num_heads)``, merges the partials::

    M = max_p m_p;  out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p

With ``num_splits == 1`` the first kernel normalises and writes the output itself. A sequence
with ``ctx_len == 0`` (a padding row of a captured batch) gets a zero output, not NaN.

FP8 cache: tiles are dequantized as they are read (:mod:`.paged_tile`); ``k_scale`` is folded
into the scores' scale and ``v_scale`` multiplies each program's ``acc`` before it is
normalised or written as a partial (the merge is linear in it). Both are read on the device.

Compiled once: ``num_splits`` and the block-table width are ordinary (not specialized)
arguments, splitting is a run-time branch, the reduction always reads ``MAX_SPLITS`` lanes
and the partial arrays keep a fixed alignment, so no batch size, split count or table width
compiles a new variant mid-run (a compile takes about a second).

Sliding windows: a row reads only the keys ``[key_lo, ctx_len)``, ``key_lo = max(ctx_len -
window, 0)``, and the partitions cut that range (not the whole table), so each row's
partitions start at its window's first key; pages left of it are never read. A windowed
layer therefore reads at most ``window`` keys per row (``ceil((window + block_size - 1) /
block_size)`` pages), and :func:`choose_num_splits` sizes its split count by that, not by
the table width: GPT-OSS's 128-token windows get one partition (no partials, no reduction),
Gemma 3's 1024 at most four.

Graph safety: the grid ``(num_seqs, num_kv_heads, num_splits)`` and the workspace shape depend
only on tensor shapes and on ``num_splits``, which :func:`choose_num_splits` derives on the
host from static facts (batch size, kv heads, SM count, block-table width, the layer's
window and head size); context lengths and block tables are only read inside the kernels.
Replaying a captured graph after rewriting those tensors in place therefore computes the new
batch correctly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.launch import launch
from pagedinfer.adapters.kernels.paged_tile import (
    LOG2_E,
    add_sinks,
    attend_paged_tile,
    check_attention_shapes,
    dot_precision,
    kv_dequant_factor,
    padded_head_dim,
    prepare_kv_cache,
    sink_logits,
    softcap_argument,
)

__all__ = [
    "MAX_SPLITS",
    "SplitPartials",
    "choose_num_splits",
    "decode_block_n",
    "paged_decode_attention",
    "split_workspace_numel",
]

# More partitions than this cost more in the reduction than they win in parallelism.
MAX_SPLITS = 16
# A partition shorter than this spends more time on its prologue and partial store than on
# streaming keys, so short contexts are not split further.
MIN_TOKENS_PER_SPLIT = 256
# Aim for about this many resident programs per SM before adding partitions.
PROGRAMS_PER_SM = 2
_SPLITS_P2 = 1 << (MAX_SPLITS - 1).bit_length()
# The window of a layer without one: longer than any context (an int32 kernel argument).
_NO_WINDOW = 1 << 30


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_context_len: int,
    num_sms: int,
    *,
    window: int | None = None,
    head_dim: int = 128,
) -> int:
    """Partitions per sequence for a decode batch, from static information only.

    ``max_context_len`` is the longest context the block tables can describe (their width
    times the block size), never the batch's actual lengths, so a captured graph and every
    replay agree. One partition when ``num_seqs * num_kv_heads`` programs already fill the
    GPU; otherwise enough to reach ``PROGRAMS_PER_SM`` programs per SM, at most
    :data:`MAX_SPLITS` and at most one per :data:`MIN_TOKENS_PER_SPLIT` tokens a row can read.

    A layer with a sliding ``window`` reads at most ``min(window, max_context_len)`` keys per
    row, so that bounds its partitions instead of the context; the count is then trimmed to
    the partitions that hold keys when a row reads that many (the kernel gives each
    partition a whole number of ``head_dim``'s key tiles, :func:`decode_block_n`), so that for
    every row whose context reaches the window, every partition does work. Without a window
    the result does not depend on ``head_dim``.
    """
    keys = max_context_len if window is None else min(max_context_len, window)
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= num_sms:
        return 1
    wanted = -(-PROGRAMS_PER_SM * num_sms // programs)  # ceil division
    by_length = max(1, keys // MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(wanted, by_length, MAX_SPLITS))
    if window is None or splits == 1:
        return splits
    return _partitions_with_keys(keys, splits, decode_block_n(head_dim))


def decode_block_n(head_dim: int) -> int:
    """Keys per tile of the decode kernel for this head size (its default ``block_n``)."""
    return 64 if padded_head_dim(head_dim) <= 128 else 32


def _partitions_with_keys(num_keys: int, num_splits: int, block_n: int) -> int:
    """How many of ``num_splits`` partitions hold keys when a row reads ``num_keys`` keys:
    the kernel's ``split_len`` (a whole number of tiles), then the partitions it fills."""
    split_len = _cdiv(_cdiv(num_keys, num_splits), block_n) * block_n
    return max(1, _cdiv(num_keys, split_len))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Every partial array starts on a multiple of this many float32 elements (64 bytes): Triton
# specializes kernels on pointer alignment, so the arrays' alignment must not depend on the
# batch size, or each new batch size would compile a new kernel.
_PARTIALS_ALIGNMENT = 16


def _aligned(numel: int) -> int:
    return -(-numel // _PARTIALS_ALIGNMENT) * _PARTIALS_ALIGNMENT


def split_workspace_numel(num_seqs: int, num_heads: int, num_splits: int, head_dim: int) -> int:
    """float32 elements of the split-KV partials for this launch (0 without splitting)."""
    if num_splits <= 1:
        return 0
    rows = num_seqs * num_heads * num_splits
    return rows * padded_head_dim(head_dim) + 2 * _aligned(rows)


@dataclass(frozen=True, slots=True)
class SplitPartials:
    """Per-partition softmax state: ``acc [B, H, S, D_pad]``, ``max`` / ``sum`` ``[B, H, S]``."""

    acc: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor

    @classmethod
    def from_buffer(
        cls,
        buffer: torch.Tensor,
        num_seqs: int,
        num_heads: int,
        num_splits: int,
        head_dim: int,
    ) -> SplitPartials:
        """Views into the front of a flat float32 ``buffer`` of at least
        :func:`split_workspace_numel` elements (no allocation: safe inside graph capture)."""
        padded = padded_head_dim(head_dim)
        rows = num_seqs * num_heads * num_splits
        assert buffer.dtype == torch.float32 and buffer.dim() == 1
        needed = split_workspace_numel(num_seqs, num_heads, num_splits, head_dim)
        assert buffer.numel() >= needed, (buffer.numel(), needed)
        # acc first (rows * padded is a multiple of 16: padded >= 16), then max and sum, each
        # starting on an aligned element.
        max_start = rows * padded
        sum_start = max_start + _aligned(rows)
        shape = (num_seqs, num_heads, num_splits)
        acc = buffer[:max_start].view(*shape, padded)
        maxes = buffer[max_start : max_start + rows].view(shape)
        sums = buffer[sum_start : sum_start + rows].view(shape)
        return cls(acc=acc, max=maxes, sum=sums)


# num_splits and the block-table row stride (its width) change from step to step; Triton would
# otherwise specialize on them (value 1, divisibility by 16) and compile mid-run. Likewise the
# int32 metadata pointers (slices of a step's packed inputs; 16-byte alignment would be a key).
@triton.jit(  # type: ignore[untyped-decorator]
    do_not_specialize=[
        "block_tables_ptr",
        "context_lens_ptr",
        "kv_scales_ptr",
        "num_splits",
        "sinks_ptr",
        "stride_table_seq",
        "window",
    ]
)
def _decode_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scales_ptr,
    block_tables_ptr,
    context_lens_ptr,
    sinks_ptr,
    qk_scale,
    num_splits,
    window,
    softcap,  # SOFTCAP: the cap in base-2 units (paged_tile.softcap_argument)
    stride_q_seq,
    stride_q_head,
    stride_out_seq,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    NUM_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_FORMAT: tl.constexpr,  # 0: the cache has q's dtype; else its bytes (see fp8.py)
    DEQUANT_FACTOR: tl.constexpr,  # fp8.DEQUANT_FACTOR of the format
    HAS_SINKS: tl.constexpr,  # sinks_ptr holds one sink logit per head
    SOFTCAP: tl.constexpr,  # scores are capped: softcap * tanh(scores / softcap)
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    ctx_len = tl.load(context_lens_ptr + seq)
    # The query sits at ctx_len - 1 and sees the last `window` keys: the partitions cover
    # [key_lo, ctx_len) only, so no page left of the window is read.
    key_lo = tl.maximum(ctx_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(ctx_len - key_lo, num_splits), BLOCK_N) * BLOCK_N
    key_start = key_lo + split * split_len
    key_end = tl.minimum(key_start + split_len, ctx_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    g_mask = offs_g < QUERIES_PER_KV
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * QUERIES_PER_KV + offs_g
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    if FP8_FORMAT != 0:  # k_scale folds into the scores' scale; v_scale is applied at the end
        qk_scale = qk_scale * (tl.load(kv_scales_ptr) * DEQUANT_FACTOR)
    kv_head_offset = kv_head.to(tl.int64) * stride_cache_head
    table_row_ptr = block_tables_ptr + seq * stride_table_seq
    acc = tl.zeros([BLOCK_G, HEAD_DIM_P2], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    row_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)

    # Whole tiles without masks, then at most one ragged tail tile. A partition past the
    # context has key_end < key_start: both are skipped and the neutral state is stored.
    num_full_tiles = (key_end - key_start) // BLOCK_N
    for tile in range(0, num_full_tiles):
        acc, row_sum, row_max = attend_paged_tile(
            acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset,
            key_start + tile * BLOCK_N, key_end, offs_g, qk_scale, stride_cache_block,
            stride_cache_slot, offs_d, d_mask, BLOCK_SIZE, BLOCK_N, False, False, DOT_PRECISION,
            FP8_FORMAT, window, False, softcap, SOFTCAP,
        )  # fmt: skip
    tail_start = key_start + num_full_tiles * BLOCK_N
    if tail_start < key_end:
        acc, row_sum, row_max = attend_paged_tile(
            acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset,
            tail_start, key_end, offs_g, qk_scale, stride_cache_block, stride_cache_slot,
            offs_d, d_mask, BLOCK_SIZE, BLOCK_N, True, False, DOT_PRECISION, FP8_FORMAT,
            window, False, softcap, SOFTCAP,
        )  # fmt: skip

    if FP8_FORMAT != 0:
        acc = acc * (tl.load(kv_scales_ptr + 1) * DEQUANT_FACTOR)
    if num_splits > 1:  # a run-time branch, the same for every program of a launch
        # Row (seq, head, split) of the [B, H, S] partial arrays; acc rows are HEAD_DIM_P2 wide.
        rows = (seq * NUM_HEADS + heads) * num_splits + split
        tl.store(part_max_ptr + rows, row_max, mask=g_mask)
        tl.store(part_sum_ptr + rows, row_sum, mask=g_mask)
        tl.store(
            part_acc_ptr + rows[:, None] * HEAD_DIM_P2 + offs_d[None, :],
            acc,
            mask=g_mask[:, None],
        )
    else:
        if HAS_SINKS:
            acc, row_sum, row_max = add_sinks(acc, row_sum, row_max, sinks_ptr, heads, g_mask)
        out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]  # empty context -> zeros
        tl.store(
            out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )


@triton.jit(do_not_specialize=["num_splits", "sinks_ptr"])  # type: ignore[untyped-decorator]
def _reduce_splits_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    sinks_ptr,
    num_splits,
    stride_out_seq,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    HAS_SINKS: tl.constexpr,  # sinks_ptr holds one sink logit per head
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM

    rows = (seq * NUM_HEADS + head) * num_splits + offs_s
    maxes = tl.load(part_max_ptr + rows, mask=s_mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + rows, mask=s_mask, other=0.0)
    global_max = tl.max(maxes, 0)
    if HAS_SINKS:  # the head's sink logit joins the denominator (base-2 units, like maxes)
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        global_max = tl.maximum(global_max, sink)
    # All partitions empty (ctx_len == 0): use 0 so the weights are 0, not NaN.
    global_max = tl.where(global_max == float("-inf"), 0.0, global_max)
    weights = tl.math.exp2(maxes - global_max)
    total = tl.sum(sums * weights, 0)
    if HAS_SINKS:
        total += tl.math.exp2(sink - global_max)
    acc = tl.load(
        part_acc_ptr + rows[:, None] * HEAD_DIM_P2 + offs_d[None, :],
        mask=s_mask[:, None],
        other=0.0,
    )
    out = tl.sum(acc * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    partials: SplitPartials | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    kv_scales: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence (``query[s]``: ``[num_heads, head_dim]``) over the
    first ``context_lens[s]`` tokens of pages ``block_tables[s]``.

    ``window`` (a sliding window): the query sees only the last ``window`` of those tokens,
    and pages holding none of them are not read (their table entries may be anything).
    ``sinks`` (``[num_heads]``): each head's learned sink logit, added to the softmax's
    denominator (GPT-OSS). ``softcap`` (> 0; ``None`` or 0: off): the scores are capped,
    ``softcap * tanh(scores / softcap)``, after the scale (Gemma 2's attention logits).

    A float8 cache is dequantized on the fly with the layer's scale row ``kv_scales`` (see
    :mod:`pagedinfer.adapters.kv_cache`; unit scales when ``None``).

    ``num_splits > 1`` writes partial results to ``partials`` (views of a preallocated buffer,
    see :meth:`SplitPartials.from_buffer`; pass them under CUDA-graph capture so the graph
    does not own a private workspace); they are allocated if missing. ``block_n``
    overrides the key-tile size (tests). Reads no device values on the host.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = int(k_cache.shape[2])
    check_attention_shapes(query, k_cache, v_cache, block_tables, num_seqs)
    assert context_lens.shape == (num_seqs,), (context_lens.shape, num_seqs)
    assert num_splits >= 1, num_splits
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    k_cache, v_cache, kv_scales, fp8 = prepare_kv_cache(k_cache, v_cache, kv_scales)

    queries_per_kv = num_heads // num_kv_heads
    padded = padded_head_dim(head_dim)
    block_n = block_n or decode_block_n(head_dim)
    split = num_splits > 1
    if split and partials is None:
        buffer = torch.empty(
            split_workspace_numel(num_seqs, num_heads, num_splits, head_dim),
            dtype=torch.float32,
            device=query.device,
        )
        partials = SplitPartials.from_buffer(buffer, num_seqs, num_heads, num_splits, head_dim)
    if partials is None:
        # Never touched without splitting; float32 (and no allocation) so that the kernel's
        # signature, hence its compiled variant, is the same with and without splitting.
        none = torch.empty(0, dtype=torch.float32, device=query.device)
        partials = SplitPartials(acc=none, max=none, sum=none)
    part_acc, part_max, part_sum = partials.acc, partials.max, partials.sum
    sink_row = sink_logits(sinks, num_heads)
    assert window is None or window >= 1, window

    launch(_decode_kernel, (num_seqs, num_kv_heads, num_splits))(
        out,
        part_acc,
        part_max,
        part_sum,
        query,
        k_cache,
        v_cache,
        kv_scales if kv_scales is not None else context_lens,  # unused without FP8
        block_tables,
        context_lens,
        sink_row if sink_row is not None else part_max,  # unused without sinks
        scale * LOG2_E,
        num_splits,
        _NO_WINDOW if window is None else window,
        softcap_argument(softcap),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_G=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_SIZE=int(k_cache.shape[1]),
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=padded,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype),
        FP8_FORMAT=fp8,
        DEQUANT_FACTOR=kv_dequant_factor(fp8),
        HAS_SINKS=sink_row is not None,
        SOFTCAP=bool(softcap),
        num_warps=4,
        num_stages=2,
    )
    if split:
        launch(_reduce_splits_kernel, (num_seqs, num_heads))(
            out,
            part_acc,
            part_max,
            part_sum,
            sink_row if sink_row is not None else part_max,  # unused without sinks
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=padded,
            SPLITS_P2=_SPLITS_P2,  # not per launch: one compiled variant for every num_splits
            HAS_SINKS=sink_row is not None,
            num_warps=4,
        )
    return out
