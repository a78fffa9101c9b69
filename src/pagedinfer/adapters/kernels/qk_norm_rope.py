"""The attention prologue in one launch: per-head RMSNorm of q and k (Qwen3), rotary position
embedding of both, and optionally the store of k and v into the paged cache.

After the packed QKV projection, the torch path runs for q and for k: a per-head RMSNorm
(seven to nine launches each), a cos/sin lookup, a float32 cast, four multiplies, a subtract,
an add, a concatenation and a cast back; then the store-KV kernel. Here program ``(t, b)``
reads block ``b`` of token ``t``'s heads from the packed ``[q | k | v]`` row once and writes
the rotated q (and k, or k and v into their cache slot) once.

Layout: ``qkv [T, (H + 2 * KV) * D]`` (rows may be strided, the last dim is contiguous), rotary
tables ``cos`` / ``sin [max_position, D / 2]`` float32, neox ("rotate half") pairing: element
``i`` of the first half rotates with element ``i`` of the second half.

Torch twin (the test oracle and the CPU path): ``qk_norm_rope_torch`` in
:mod:`pagedinfer.adapters.layers.rotary`, built from ``rms_norm_torch`` and ``apply_rotary``.
Numerics follow it: float32 statistics, the normalised head rounded to the model dtype, times
the weight rounded again, then the rotation in float32 of those rounded values, rounded once
at the end.

Grid: ``(T, cdiv(H, BLOCK_H) + cdiv(KV, BLOCK_H))``; the first column blocks are q heads, the
rest k heads (which also move v when storing). Shapes only: CUDA-graph safe; a slot ``< 0``
(padding row) is masked off on the device.

FP8 cache: the store writes the cache's bytes, the rotated k and the v quantized with the
layer's inverse scales (``kv_scales[2]``, ``kv_scales[3]``, read on the device) exactly as
:mod:`.store_kv` does: the rotated k is first rounded to the model dtype (what the unfused
path would hand to the store), then quantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.fp8 import NO_FP8, cache_bytes, fp8_format, quantize_fp8
from pagedinfer.adapters.kernels.launch import launch
from pagedinfer.adapters.kv_cache import unit_scales

__all__ = ["qk_norm_rope", "qk_norm_rope_store"]

# Elements (heads x head dim) one program handles: enough work, few registers.
_ELEMENTS_PER_PROGRAM = 2048


@triton.jit  # type: ignore[untyped-decorator]
def _norm_rope_tile(  # type: ignore[no-untyped-def]
    x1,  # [BLOCK_H, HALF_P2] first halves of the heads, model dtype
    x2,  # [BLOCK_H, HALF_P2] second halves
    weight_ptr,
    cos,  # [HALF_P2] float32
    sin,
    eps,
    offs_half,
    half_mask,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    if HAS_NORM:
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        variance = (tl.sum(x1f * x1f, 1) + tl.sum(x2f * x2f, 1)) / HEAD_DIM
        rstd = tl.math.rsqrt(variance + eps)[:, None]
        w1 = tl.load(weight_ptr + offs_half, mask=half_mask, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + offs_half, mask=half_mask, other=0.0).to(tl.float32)
        # Rounded to the model dtype twice, as RMSNorm does: after normalising, after weighting.
        x1 = ((x1f * rstd).to(x1.dtype).to(tl.float32) * w1[None, :]).to(x1.dtype)
        x2 = ((x2f * rstd).to(x2.dtype).to(tl.float32) * w2[None, :]).to(x2.dtype)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    y1 = a * cos[None, :] - b * sin[None, :]
    y2 = b * cos[None, :] + a * sin[None, :]
    return y1, y2


@triton.jit(do_not_specialize=["kv_scales_ptr"])  # type: ignore[untyped-decorator]
def _qk_norm_rope_kernel(  # type: ignore[no-untyped-def]
    q_out_ptr,
    k_out_ptr,
    qkv_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    kv_scales_ptr,
    eps,
    stride_qkv,
    stride_q_out,
    stride_k_out,
    stride_cos,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_Q_BLOCKS: tl.constexpr,  # cdiv(NUM_HEADS, BLOCK_H): column blocks of q heads
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_FORMAT: tl.constexpr,  # see fp8.py; 0: the cache has the model's dtype
):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)

    offs_h = tl.arange(0, BLOCK_H)
    offs_half = tl.arange(0, HALF_P2)
    half_mask = offs_half < HALF
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + position * stride_cos + offs_half, mask=half_mask, other=0.0)
    sin = tl.load(sin_ptr + position * stride_cos + offs_half, mask=half_mask, other=0.0)
    row_ptr = qkv_ptr + token * stride_qkv

    if head_block < NUM_Q_BLOCKS:
        heads = head_block * BLOCK_H + offs_h
        mask = (heads < NUM_HEADS)[:, None] & half_mask[None, :]
        in_offs = heads[:, None] * HEAD_DIM + offs_half[None, :]
        x1 = tl.load(row_ptr + in_offs, mask=mask, other=0.0)
        x2 = tl.load(row_ptr + in_offs + HALF, mask=mask, other=0.0)
        y1, y2 = _norm_rope_tile(
            x1, x2, q_weight_ptr, cos, sin, eps, offs_half, half_mask, HEAD_DIM, HALF, HAS_NORM
        )
        out_ptr = q_out_ptr + token * stride_q_out + in_offs
        tl.store(out_ptr, y1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + HALF, y2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        heads = (head_block - NUM_Q_BLOCKS) * BLOCK_H + offs_h
        mask = (heads < NUM_KV_HEADS)[:, None] & half_mask[None, :]
        head_offs = heads[:, None] * HEAD_DIM + offs_half[None, :]
        k_offs = NUM_HEADS * HEAD_DIM + head_offs
        x1 = tl.load(row_ptr + k_offs, mask=mask, other=0.0)
        x2 = tl.load(row_ptr + k_offs + HALF, mask=mask, other=0.0)
        y1, y2 = _norm_rope_tile(
            x1, x2, k_weight_ptr, cos, sin, eps, offs_half, half_mask, HEAD_DIM, HALF, HAS_NORM
        )
        if STORE_KV:
            slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
            # A branch, not ``mask & (slot >= 0)``: Triton 3.9's interpreter turns a scalar
            # comparison broadcast into a block into an int32 mask, which its store refuses
            # ("mask has unsupported dtype"). store_kv skips padding rows the same way.
            if slot >= 0:
                page = slot // BLOCK_SIZE
                cache_offs = (
                    page * stride_cache_block
                    + (slot % BLOCK_SIZE) * stride_cache_slot
                    + heads[:, None] * stride_cache_head
                    + offs_half[None, :]
                )
                k_dst = k_cache_ptr + cache_offs
                v_offs = (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + head_offs
                v1 = tl.load(row_ptr + v_offs, mask=mask, other=0.0)
                v2 = tl.load(row_ptr + v_offs + HALF, mask=mask, other=0.0)
                v_dst = v_cache_ptr + cache_offs
                # New names for the bytes: inside this run-time branch, Triton's compiler
                # refuses a variable whose type changes (y1 float32 -> uint8), though the
                # interpreter accepts it.
                if FP8_FORMAT != 0:
                    k_inverse = tl.load(kv_scales_ptr + 2)
                    v_inverse = tl.load(kv_scales_ptr + 3)
                    k1_bytes = quantize_fp8(y1.to(x1.dtype), k_inverse, FP8_FORMAT)
                    k2_bytes = quantize_fp8(y2.to(x1.dtype), k_inverse, FP8_FORMAT)
                    tl.store(k_dst, k1_bytes, mask=mask)
                    tl.store(k_dst + HALF, k2_bytes, mask=mask)
                    tl.store(v_dst, quantize_fp8(v1, v_inverse, FP8_FORMAT), mask=mask)
                    tl.store(v_dst + HALF, quantize_fp8(v2, v_inverse, FP8_FORMAT), mask=mask)
                else:
                    tl.store(k_dst, y1.to(k_cache_ptr.dtype.element_ty), mask=mask)
                    tl.store(k_dst + HALF, y2.to(k_cache_ptr.dtype.element_ty), mask=mask)
                    tl.store(v_dst, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
                    tl.store(v_dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)
        else:
            k_dst = k_out_ptr + token * stride_k_out + head_offs
            tl.store(k_dst, y1.to(k_out_ptr.dtype.element_ty), mask=mask)
            tl.store(k_dst + HALF, y2.to(k_out_ptr.dtype.element_ty), mask=mask)


def _launch(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    kv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    num_tokens = int(qkv.shape[0])
    assert head_dim % 2 == 0, head_dim
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert qkv.stride(1) == 1, "the packed projection's last dim must be contiguous"
    assert positions.shape == (num_tokens,), (positions.shape, num_tokens)
    half = head_dim // 2
    assert cos.shape == sin.shape and cos.shape[1] == half and cos.stride() == sin.stride()
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride(1) == 1
    has_norm = q_weight is not None
    assert (k_weight is not None) == has_norm, "q and k are normalised together or not at all"
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k: torch.Tensor | None = None
    if cache is None:
        k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        k_cache = v_cache = k  # unused by the kernel
        slot_mapping = positions
        cache_strides = (0, 0, 0)
        block_size = 1
        fp8 = NO_FP8
    else:
        k_cache, v_cache, slot_mapping = cache
        fp8 = fp8_format(k_cache.dtype)
        if fp8 != NO_FP8 and kv_scales is None:
            kv_scales = unit_scales(k_cache.device)
        assert kv_scales is None or kv_scales.dtype == torch.float32
        assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
        assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.stride(3) == 1
        assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, num_tokens)
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        block_size = int(k_cache.shape[1])
    if num_tokens == 0:
        return q, k
    half_p2 = triton.next_power_of_2(half)
    block_h = min(
        triton.next_power_of_2(max(num_heads, num_kv_heads)),
        max(1, _ELEMENTS_PER_PROGRAM // (2 * half_p2)),
    )
    num_q_blocks = triton.cdiv(num_heads, block_h)
    grid = (num_tokens, num_q_blocks + triton.cdiv(num_kv_heads, block_h))
    launch(_qk_norm_rope_kernel, grid)(
        q,
        k if k is not None else q,
        qkv,
        positions,
        cos,
        sin,
        q_weight if q_weight is not None else cos,
        k_weight if k_weight is not None else cos,
        cache_bytes(k_cache),
        cache_bytes(v_cache),
        slot_mapping,
        kv_scales if kv_scales is not None else cos,  # unused without FP8
        eps,
        qkv.stride(0),
        q.stride(0),
        k.stride(0) if k is not None else 0,
        cos.stride(0),
        *cache_strides,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_P2=half_p2,
        BLOCK_H=block_h,
        NUM_Q_BLOCKS=num_q_blocks,
        HAS_NORM=has_norm,
        STORE_KV=cache is not None,
        BLOCK_SIZE=block_size,
        FP8_FORMAT=fp8,
        num_warps=4 if block_h * half_p2 >= 512 else 1,
    )
    return q, k


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (and, with weights, per-head RMS-normed) ``q [T, H, D]`` and ``k [T, KV, D]``
    from the packed projection, in one launch. ``v`` stays a view of ``qkv``."""
    q, k = _launch(
        qkv,
        positions,
        cos,
        sin,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_weight=q_weight,
        k_weight=k_weight,
        eps=eps,
        cache=None,
    )
    assert k is not None
    return q, k


def qk_norm_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """As :func:`qk_norm_rope`, but k and v go straight into their cache slots (slots ``< 0``
    are skipped; a float8 cache gets them quantized with the scale row ``kv_scales``, unit
    scales when ``None``); returns the rotated ``q [T, H, D]``. One launch for the whole
    prologue."""
    q, _ = _launch(
        qkv,
        positions,
        cos,
        sin,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_weight=q_weight,
        k_weight=k_weight,
        eps=eps,
        cache=(k_cache, v_cache, slot_mapping),
        kv_scales=kv_scales,
    )
    return q
