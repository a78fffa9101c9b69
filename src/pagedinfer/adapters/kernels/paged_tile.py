"""One online-softmax step over a tile of keys read through a block table.

Both attention kernels walk a sequence's context in tiles of ``BLOCK_N`` key positions and
call :func:`attend_paged_tile` once per tile. The tile size and the cache's page size are
independent: every key position ``n`` looks up its own page,
``block_table[n // BLOCK_SIZE]``, and its row inside the page, ``n % BLOCK_SIZE``, so a tile may
lie inside one page or span several.

Online softmax (FlashAttention): the running state per query row is the maximum score seen
so far ``m``, the sum of ``exp(score - m)`` ``l`` and the unnormalised output ``acc``. A new
tile with scores ``s`` updates them as::

    m' = max(m, rowmax(s));  alpha = exp(m - m');  p = exp(s - m')
    l' = alpha * l + rowsum(p);  acc' = alpha * acc + p @ V

The scale ``qk_scale`` already contains ``log2(e)``, so ``exp`` is the cheaper ``exp2`` and
``m`` is kept in base-2 units; the final output is ``acc / l``. A row that has seen no key yet
has ``m = -inf``; callers guarantee each row meets a visible key in its first tile, so
``m - m'`` is never ``-inf - (-inf)``.

The module also holds the few host-side helpers both attention wrappers share: the
``log2(e)`` factor, the ``tl.dot`` precision per dtype, the padded head dim and the shape
invariants they assert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "LOG2_E",
    "attend_paged_tile",
    "check_attention_shapes",
    "dot_precision",
    "padded_head_dim",
]

LOG2_E = 1.4426950408889634


@triton.jit  # type: ignore[untyped-decorator]
def attend_paged_tile(  # type: ignore[no-untyped-def]
    acc,  # [M, HEAD_DIM_P2] float32, unnormalised output
    row_sum,  # [M] float32
    row_max,  # [M] float32, base-2 units
    q,  # [M, HEAD_DIM_P2] queries of one head (or of one GQA group)
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,  # this sequence's row of the block table
    kv_head_offset,  # kv_head * stride_head, int64
    key_start,  # first key position of this tile
    key_end,  # keys at positions >= key_end are neither read nor attended (MASK_KEYS)
    query_positions,  # [M] absolute positions of the query rows (CAUSAL)
    qk_scale,  # softmax scale * log2(e)
    stride_block,  # cache stride between pages (int64)
    stride_slot,  # cache stride between rows of a page
    offs_d,  # [HEAD_DIM_P2] arange
    d_mask,  # [HEAD_DIM_P2] offs_d < HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # tokens per cache page
    BLOCK_N: tl.constexpr,  # keys per tile
    MASK_KEYS: tl.constexpr,  # the tile may reach past key_end
    CAUSAL: tl.constexpr,  # row r may only see keys at positions <= query_positions[r]
    DOT_PRECISION: tl.constexpr,  # see dot_precision()
):
    offs_n = key_start + tl.arange(0, BLOCK_N)
    # Per-token page lookup: int64 because page * stride_block can pass 2**31 elements.
    if MASK_KEYS:
        n_mask = offs_n < key_end
        page = tl.load(table_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
    else:
        page = tl.load(table_row_ptr + offs_n // BLOCK_SIZE)
    token_offset = page.to(tl.int64) * stride_block + (offs_n % BLOCK_SIZE) * stride_slot
    token_offset += kv_head_offset

    # K is read transposed, [HEAD_DIM_P2, BLOCK_N], so the scores are a plain q @ k.
    k_ptrs = k_cache_ptr + token_offset[None, :] + offs_d[:, None]
    if MASK_KEYS:
        k = tl.load(k_ptrs, mask=d_mask[:, None] & n_mask[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if CAUSAL:
        visible = offs_n[None, :] <= query_positions[:, None]
        if MASK_KEYS:
            visible = visible & n_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    elif MASK_KEYS:
        scores = tl.where(n_mask[None, :], scores, float("-inf"))

    new_max = tl.maximum(row_max, tl.max(scores, 1))
    alpha = tl.math.exp2(row_max - new_max)
    p = tl.math.exp2(scores - new_max[:, None])
    row_sum = row_sum * alpha + tl.sum(p, 1)

    v_ptrs = v_cache_ptr + token_offset[:, None] + offs_d[None, :]
    if MASK_KEYS:
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, row_sum, new_max


def padded_head_dim(head_dim: int) -> int:
    """The head dim rounded up to a power of two and to >= 16 (``tl.arange`` / ``tl.dot`` sizes)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str | None:
    """``tl.dot`` input precision: exact products for float32 inputs (Triton would round them
    to TF32 on tensor cores); the default (``None``) for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else None


def check_attention_shapes(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_seqs: int,
) -> None:
    """Internal invariants the attention backends guarantee (not user input)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.dim() == 4 and k_cache.shape[3] == head_dim, (k_cache.shape, query.shape)
    assert k_cache.stride(3) == 1, "the cache's head dim must be contiguous"
    assert num_heads % k_cache.shape[2] == 0, (num_heads, k_cache.shape[2])
    assert k_cache.dtype == query.dtype, (k_cache.dtype, query.dtype)
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert block_tables.stride(1) == 1, "block-table rows must be contiguous"
