"""Varlen causal attention over the paged cache: prefill, prefix-cache hits, chunked prefill.

The step's own K/V are stored into the cache first, so every key a query may see is read
through the block table; one kernel serves a fresh prompt (no prefix), a prompt whose first
blocks came from the prefix cache, and any chunk of a long prompt.

Positions (bottom-right aligned causal mask): sequence ``s`` has ``q_len`` queries this step
and ``ctx_len`` keys in total. Query ``i`` sits at position ``ctx_len - q_len + i`` and sees
keys ``0 ..= ctx_len - q_len + i``.

Grid ``(cdiv(max_seqlen_q, BLOCK_M), num_heads, num_seqs)``: one program per tile of
``BLOCK_M`` queries of one head of one sequence (FlashAttention-2 style). Programs whose
tile starts past their sequence's ``q_len`` return at once. Tiles are visited last-first so
the longest-running tiles (the ones that see the most keys) are scheduled before short ones.
The grid depends on the host int ``max_seqlen_q``, which is fine: prefill is never captured.

Inner loop, in key tiles of ``BLOCK_N`` (see :mod:`.paged_tile` for the page lookup and the
online softmax): first the tiles every query row of the program sees in full, with no mask
at all, then the few tiles on the diagonal, with the causal mask. A K/V head serves
``num_heads / num_kv_heads`` query heads (GQA) by index arithmetic; nothing is repeated.

Head dims that are not a power of two are padded to the next one with masked loads; the
scores and output are float32 inside the kernel and cast to the output dtype on store.

FP8 cache: tiles are dequantized as they are read (:mod:`.paged_tile`); ``k_scale`` is folded
into the scores' scale and ``v_scale`` multiplies ``acc`` before it is normalised, both read on
the device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
from pagedinfer.adapters.kernels.target import kernel_target

__all__ = ["PrefillTiles", "choose_prefill_tiles", "paged_prefill_attention"]


@dataclass(frozen=True, slots=True)
class PrefillTiles:
    """Launch shape of the prefill kernel: query rows and keys per tile, warps, stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            size = getattr(self, name)
            # tl.dot needs both operand sides >= 16 and powers of two.
            assert size >= 16 and size & (size - 1) == 0, f"{name}={size}"


def choose_prefill_tiles(
    head_dim: int, dtype: torch.dtype, max_seqlen_q: int, shared_memory: int | None = None
) -> PrefillTiles:
    """Tile sizes for an H100-class GPU, by padded head dim and element size, shrunk to fit
    ``shared_memory`` bytes per block (the target's; ``None``: no limit).

    Per stage the kernel holds a K and a V tile (``BLOCK_N x D``) in shared memory; the
    choices keep three stages under ~150 KB for 16-bit types and leave registers for the
    ``BLOCK_M x D`` float32 accumulator. Short query batches (small chunks, decode-like
    prefills) use 64 rows so fewer rows are wasted on padding. Where the stages do not fit
    (float32 with head dim 256 on sm_86 / sm_89's 99 KiB: 64 x 32 tiles need 136 KiB, 64 x 16
    100 KiB), ``BLOCK_N`` then ``BLOCK_M`` halve, down to 16, then stages go, until the
    stages and a query tile's worth of scratch fit (32 x 16 there); the GPU preflight checks
    the compiled figure for every target.
    """
    padded = padded_head_dim(head_dim)
    wide = dtype == torch.float32
    if padded >= 256 or wide:
        tiles = PrefillTiles(
            block_m=64, block_n=32, num_warps=4 if padded <= 64 else 8, num_stages=2
        )
    else:
        block_m = 64 if max_seqlen_q <= 64 else 128
        tiles = PrefillTiles(
            block_m=block_m,
            block_n=64,
            num_warps=4 if padded <= 64 or block_m == 64 else 8,
            num_stages=3,
        )
    if shared_memory is None:
        return tiles
    element_size = dtype.itemsize

    def pipeline_bytes(t: PrefillTiles) -> int:  # the K and V tiles of every stage
        return t.num_stages * 2 * t.block_n * padded * element_size

    def with_queries(t: PrefillTiles) -> int:  # and a query tile's worth of scratch
        return pipeline_bytes(t) + t.block_m * padded * element_size

    if pipeline_bytes(tiles) <= shared_memory:
        return tiles
    while with_queries(tiles) > shared_memory and tiles.block_n > 16:
        tiles = replace(tiles, block_n=tiles.block_n // 2)
    while with_queries(tiles) > shared_memory and tiles.block_m > 16:
        tiles = replace(tiles, block_m=tiles.block_m // 2)
    while with_queries(tiles) > shared_memory and tiles.num_stages > 1:
        tiles = replace(tiles, num_stages=tiles.num_stages - 1)
    return tiles


# Not specialization keys, or a new kernel would compile mid-run (~1 s each; seen on an H100):
# the block-table row stride (the step's table width) changes from step to step, and the
# int32 metadata of a mixed step's prefill rows are slices that start after the decode rows,
# at any 4-byte offset (Triton specializes pointers on 16-byte alignment; these are only
# ever read one element at a time, so the alignment buys nothing).
@triton.jit(  # type: ignore[untyped-decorator]
    do_not_specialize=[
        "block_tables_ptr",
        "cu_seqlens_q_ptr",
        "context_lens_ptr",
        "kv_scales_ptr",
        "sinks_ptr",
        "stride_table_seq",
        "window",
    ]
)
def _prefill_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scales_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    sinks_ptr,
    qk_scale,
    window,
    softcap,  # SOFTCAP: the cap in base-2 units (paged_tile.softcap_argument)
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_FORMAT: tl.constexpr,  # 0: the cache has q's dtype; else its bytes (see fp8.py)
    DEQUANT_FACTOR: tl.constexpr,  # fp8.DEQUANT_FACTOR of the format
    SLIDING: tl.constexpr,  # query at position p sees keys p - window < n <= p only
    HAS_SINKS: tl.constexpr,  # sinks_ptr holds one sink logit per head
    SOFTCAP: tl.constexpr,  # scores are capped: softcap * tanh(scores / softcap)
):
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # longest-running tiles first
    head = tl.program_id(1)
    seq = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_row = q_tile * BLOCK_M
    if first_row >= q_len:
        return
    ctx_len = tl.load(context_lens_ptr + seq)
    prefix_len = ctx_len - q_len  # keys stored by earlier steps

    offs_m = first_row + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    positions = prefix_len + offs_m

    if FP8_FORMAT != 0:  # k_scale folds into the scores' scale; v_scale is applied at the end
        qk_scale = qk_scale * (tl.load(kv_scales_ptr) * DEQUANT_FACTOR)
    kv_head_offset = (head // QUERIES_PER_KV).to(tl.int64) * stride_cache_head
    table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    if SLIDING:
        acc, row_sum, row_max = _attend_window(
            acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset,
            prefix_len, first_row, q_len, ctx_len, positions, qk_scale, window,
            stride_cache_block, stride_cache_slot, offs_d, d_mask, BLOCK_SIZE, BLOCK_M, BLOCK_N,
            DOT_PRECISION, FP8_FORMAT, softcap, SOFTCAP,
        )  # fmt: skip
    else:
        # Keys 0 ..= prefix_len + first_row are visible to every row of this tile (and lie inside
        # the context): whole tiles of them need no mask. Key 0 is always among the first tile
        # processed, so every row has a finite maximum before it meets a fully masked tile.
        num_full_tiles = (prefix_len + first_row + 1) // BLOCK_N
        for tile in range(0, num_full_tiles):
            acc, row_sum, row_max = attend_paged_tile(
                acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset,
                tile * BLOCK_N, ctx_len, positions, qk_scale, stride_cache_block, stride_cache_slot,
                offs_d, d_mask, BLOCK_SIZE, BLOCK_N, False, False, DOT_PRECISION, FP8_FORMAT,
                window, False, softcap, SOFTCAP,
            )  # fmt: skip
        # The diagonal: keys up to the last row's position, causally masked.
        last_key = prefix_len + tl.minimum(first_row + BLOCK_M, q_len)  # exclusive
        for tile in range(num_full_tiles, tl.cdiv(last_key, BLOCK_N)):
            acc, row_sum, row_max = attend_paged_tile(
                acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset,
                tile * BLOCK_N, ctx_len, positions, qk_scale, stride_cache_block, stride_cache_slot,
                offs_d, d_mask, BLOCK_SIZE, BLOCK_N, True, True, DOT_PRECISION, FP8_FORMAT,
                window, False, softcap, SOFTCAP,
            )  # fmt: skip

    if FP8_FORMAT != 0:
        acc = acc * (tl.load(kv_scales_ptr + 1) * DEQUANT_FACTOR)
    if HAS_SINKS:
        heads = head + tl.zeros([BLOCK_M], dtype=tl.int32)
        acc, row_sum, row_max = add_sinks(acc, row_sum, row_max, sinks_ptr, heads, m_mask)
    out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_out_token + head * stride_out_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


@triton.jit  # type: ignore[untyped-decorator]
def _attend_window(  # type: ignore[no-untyped-def]
    acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset,
    prefix_len, first_row, q_len, ctx_len, positions, qk_scale, window,
    stride_cache_block, stride_cache_slot, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_FORMAT: tl.constexpr, softcap, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """The key loop of a tile of queries with a sliding window.

    Rows sit at positions ``first .. last``; row ``p`` sees keys ``p - window < n <= p``.
    Keys ``[lo, last]`` are read (``lo``: the first row's first key), in tiles starting at
    ``lo``, so no page left of every row's window is touched. The keys every row sees,
    ``[last - window + 1, first]``, come in whole unmasked tiles where they fill one; the
    tiles before (the window's left edge) and after (the diagonal) are masked by position.
    """
    first = prefix_len + first_row
    last = prefix_len + tl.minimum(first_row + BLOCK_M, q_len) - 1
    lo = tl.maximum(first - window + 1, 0)
    shared_lo = tl.maximum(last - window + 1, 0)  # every row's window starts at or before
    # Left edge: tiles from lo that hold a key left of shared_lo.
    num_edge = tl.cdiv(tl.maximum(shared_lo - lo, 0), BLOCK_N)
    for tile in range(0, num_edge):
        acc, row_sum, row_max = attend_paged_tile(
            acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset,
            lo + tile * BLOCK_N, ctx_len, positions, qk_scale, stride_cache_block,
            stride_cache_slot, offs_d, d_mask, BLOCK_SIZE, BLOCK_N, True, True, DOT_PRECISION,
            FP8_FORMAT, window, True, softcap, SOFTCAP,
        )  # fmt: skip
    start = lo + num_edge * BLOCK_N
    # Middle: whole tiles of keys every row sees (none past `first`).
    num_full = tl.maximum(first + 1 - start, 0) // BLOCK_N
    for tile in range(0, num_full):
        acc, row_sum, row_max = attend_paged_tile(
            acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset,
            start + tile * BLOCK_N, ctx_len, positions, qk_scale, stride_cache_block,
            stride_cache_slot, offs_d, d_mask, BLOCK_SIZE, BLOCK_N, False, False,
            DOT_PRECISION, FP8_FORMAT, window, False, softcap, SOFTCAP,
        )  # fmt: skip
    start += num_full * BLOCK_N
    # Diagonal: the rest up to the last row's position.
    for tile in range(0, tl.cdiv(tl.maximum(last + 1 - start, 0), BLOCK_N)):
        acc, row_sum, row_max = attend_paged_tile(
            acc, row_sum, row_max, q, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset,
            start + tile * BLOCK_N, ctx_len, positions, qk_scale, stride_cache_block,
            stride_cache_slot, offs_d, d_mask, BLOCK_SIZE, BLOCK_N, True, True, DOT_PRECISION,
            FP8_FORMAT, window, True, softcap, SOFTCAP,
        )  # fmt: skip
    return acc, row_sum, row_max


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    out: torch.Tensor | None = None,
    tiles: PrefillTiles | None = None,
    kv_scales: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` (``[T, num_heads, head_dim]``) over the paged context.

    Sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and attends to the
    first ``context_lens[s]`` tokens of pages ``block_tables[s]``, which must already hold
    this step's K/V. ``tiles`` overrides :func:`choose_prefill_tiles` (tests use small tiles
    to cross many tile boundaries on short contexts). A float8 cache is dequantized on the
    fly with the layer's scale row ``kv_scales`` (unit scales when ``None``). ``window``: a
    sliding window (query at position ``p`` sees keys ``p - window < n <= p``; pages left of
    the chunk's first window are never read). ``sinks`` (``[num_heads]``): each head's sink
    logit in the softmax's denominator. ``softcap`` (> 0; ``None`` or 0: off): the scores are
    capped, ``softcap * tanh(scores / softcap)``, after the scale and before the causal and
    window masks (Gemma 2). Returns ``out``, allocated if ``None``.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = int(context_lens.shape[0])
    num_kv_heads = int(k_cache.shape[2])
    check_attention_shapes(query, k_cache, v_cache, block_tables, num_seqs)
    assert cu_seqlens_q.shape == (num_seqs + 1,), (cu_seqlens_q.shape, num_seqs)
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    k_cache, v_cache, kv_scales, fp8 = prepare_kv_cache(k_cache, v_cache, kv_scales)
    if tiles is None:
        target = kernel_target(query.device)
        shared = target.shared_memory if target is not None else None
        tiles = choose_prefill_tiles(head_dim, query.dtype, max_seqlen_q, shared)
    sink_row = sink_logits(sinks, num_heads)
    assert window is None or window >= 1, window

    grid = (triton.cdiv(max_seqlen_q, tiles.block_m), num_heads, num_seqs)
    launch(_prefill_kernel, grid)(
        out,
        query,
        k_cache,
        v_cache,
        kv_scales if kv_scales is not None else context_lens,  # unused without FP8
        block_tables,
        cu_seqlens_q,
        context_lens,
        sink_row if sink_row is not None else context_lens,  # unused without sinks
        scale * LOG2_E,
        0 if window is None else window,
        softcap_argument(softcap),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_SIZE=int(k_cache.shape[1]),
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=padded_head_dim(head_dim),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        DOT_PRECISION=dot_precision(query.dtype),
        FP8_FORMAT=fp8,
        DEQUANT_FACTOR=kv_dequant_factor(fp8),
        SLIDING=window is not None,
        HAS_SINKS=sink_row is not None,
        SOFTCAP=bool(softcap),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
