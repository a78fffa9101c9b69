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
``m - m'`` is never ``-inf - (-inf)``. With a sliding window (``WINDOW``) a row may see
nothing of a tile (its window starts later): such a row keeps ``m = -inf`` through a stand-in
maximum of 0, so ``alpha`` and ``p`` are 0, never NaN.

Sliding window: query row ``r`` at position ``p`` sees keys ``p - window < n <= p`` (the
``window`` most recent positions, itself included: transformers' rule). The callers start
their key loops at the window's first key, so no key left of every row's window is loaded:
pages wholly outside the window are never read (a KV manager may have freed them).

Logit softcapping (``SOFTCAP``, Gemma 2): each score becomes ``cap * tanh(score / cap)``
after the scale and before the masks, as transformers' eager attention does. In base-2 units
that is ``c * tanh(s / c)`` with ``c = cap * log2(e)`` (the caller passes ``softcap`` so), since
``cap * tanh(x / cap) * log2(e) = c * tanh(x * log2(e) / c)``. ``tanh`` is built from ``exp2``
(:func:`soft_cap`): the interpreter and every GPU target have it.

FP8 cache (``FP8_FORMAT != 0``, see :mod:`.fp8`): the caller passes the cache's bytes; each
K and V tile is dequantized in registers to float16 values (exact; e4m3 reads as
``value * 2**-8``) and converted to the query's dtype for ``tl.dot`` (exact again: three or
two mantissa bits fit every float type). The scales are not applied here: the caller folds
``k_scale`` (times :data:`~.fp8.DEQUANT_FACTOR`) into ``qk_scale`` and multiplies the final
``acc`` by ``v_scale`` (times the same factor), both linear in the tile's values.

The module also holds the few host-side helpers both attention wrappers share: the
``log2(e)`` factor, the ``tl.dot`` precision per dtype, the padded head dim and the shape
invariants they assert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.fp8 import DEQUANT_FACTOR, dequantize_fp8, fp8_format
from pagedinfer.adapters.kv_cache import is_fp8, unit_scales

__all__ = [
    "LOG2_E",
    "add_sinks",
    "attend_paged_tile",
    "check_attention_shapes",
    "dot_precision",
    "kv_dequant_factor",
    "padded_head_dim",
    "prepare_kv_cache",
    "sink_logits",
    "soft_cap",
    "softcap_argument",
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
    FP8_FORMAT: tl.constexpr,  # 0: the cache has q's dtype; else its bytes (see fp8.py)
    window,  # sliding window (WINDOW): row r sees keys > query_positions[r] - window
    WINDOW: tl.constexpr,  # mask keys left of each row's window (implies CAUSAL)
    softcap,  # SOFTCAP: the cap in base-2 units (cap * log2(e))
    SOFTCAP: tl.constexpr,  # scores become softcap * tanh(scores / softcap)
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
        k = tl.load(k_ptrs, mask=d_mask[:, None] & n_mask[None, :], other=0)
    else:
        k = tl.load(k_ptrs, mask=d_mask[:, None], other=0)
    if FP8_FORMAT != 0:
        k = dequantize_fp8(k, FP8_FORMAT).to(q.dtype)
    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        scores = soft_cap(scores, softcap)
    if CAUSAL or WINDOW:
        visible = offs_n[None, :] <= query_positions[:, None]
        if WINDOW:
            visible = visible & (offs_n[None, :] > query_positions[:, None] - window)
        if MASK_KEYS:
            visible = visible & n_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    elif MASK_KEYS:
        scores = tl.where(n_mask[None, :], scores, float("-inf"))

    new_max = tl.maximum(row_max, tl.max(scores, 1))
    if WINDOW:  # a row may meet its first visible key after a tile it saw nothing of
        new_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    alpha = tl.math.exp2(row_max - new_max)
    p = tl.math.exp2(scores - new_max[:, None])
    row_sum = row_sum * alpha + tl.sum(p, 1)

    v_ptrs = v_cache_ptr + token_offset[:, None] + offs_d[None, :]
    if MASK_KEYS:
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0)
    else:
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0)
    if FP8_FORMAT != 0:
        v = dequantize_fp8(v, FP8_FORMAT).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def soft_cap(scores, cap):  # type: ignore[no-untyped-def]
    """``cap * tanh(scores / cap)``, with ``tanh(x) = sign(x) (1 - e) / (1 + e)``,
    ``e = exp(-2 |x|)`` (no overflow for any finite ``x``; absolute error ~1 ulp of ``cap``)."""
    x = scores / cap
    e = tl.math.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2|x|) = 2^(-2 log2(e) |x|)
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0.0, -t, t)


def softcap_argument(softcap: float | None) -> float:
    """The kernels' ``softcap`` argument: the cap in base-2 units, 0.0 when off (``None`` or
    0, transformers' "no softcapping")."""
    if not softcap:
        return 0.0
    assert softcap > 0.0, softcap
    return float(softcap) * LOG2_E


@triton.jit
def add_sinks(  # type: ignore[no-untyped-def]
    acc,  # [M, HEAD_DIM_P2] float32, unnormalised output
    row_sum,  # [M] float32
    row_max,  # [M] float32, base-2 units
    sinks_ptr,  # float32 [num_heads]: each head's sink logit (natural units)
    heads,  # [M] the head of each row
    row_mask,  # [M] rows to load a sink for
):
    """Learned attention sinks (GPT-OSS): one extra logit per head in the softmax's
    denominator, with no value. Returns ``(acc, row_sum, row_max)`` rescaled to the maximum
    of the scores and the sink; ``acc / row_sum`` is then the output."""
    sink = tl.load(sinks_ptr + heads, mask=row_mask, other=float("-inf")) * 1.4426950408889634
    new_max = tl.maximum(row_max, sink)
    new_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    alpha = tl.math.exp2(row_max - new_max)
    row_sum = row_sum * alpha + tl.math.exp2(sink - new_max)
    return acc * alpha[:, None], row_sum, new_max


def sink_logits(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """The sinks as the kernels read them: float32, contiguous, one per query head."""
    if sinks is None:
        return None
    assert sinks.shape == (num_heads,), (sinks.shape, num_heads)
    return sinks.to(torch.float32).contiguous()


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
    assert k_cache.dtype == query.dtype or is_fp8(k_cache.dtype), (k_cache.dtype, query.dtype)
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert block_tables.stride(1) == 1, "block-table rows must be contiguous"


def prepare_kv_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """What the attention kernels are given for the cache: ``(k, v, scales, FP8_FORMAT)``.

    A float8 cache becomes its bytes, with its scale row (unit scales when ``None``); a cache
    in the query's dtype is passed as it is, with no scales.
    """
    fmt = fp8_format(k_cache.dtype)
    if not fmt:
        return k_cache, v_cache, None, fmt
    if kv_scales is None:
        kv_scales = unit_scales(k_cache.device)
    assert kv_scales.dtype == torch.float32 and kv_scales.numel() >= 2, kv_scales
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), kv_scales, fmt


def kv_dequant_factor(fp8: int) -> float:
    """What the dequantized tiles are multiplied by besides the scales (256 for e4m3)."""
    return DEQUANT_FACTOR[fp8]
