"""Store-KV kernel: write each token's K and V into its slot of the paged cache.

Caches are ``[num_blocks, block_size, kv_heads, head_dim]``; slot ``s`` is row ``s % block_size``
of page ``s // block_size``. ``slot_mapping[t] < 0`` means "do not store" (the padding rows of
a captured CUDA graph).

Tiling and grid: program ``(t, h)`` copies token ``t``'s K and V for a tile of ``BLOCK_H``
kv heads times the head dim padded to a power of two (``BLOCK_D``; the padding is masked, so
any head dim works). ``BLOCK_H`` keeps a program near 2K elements, e.g. all 8 kv heads of a
128-dim model in one program. Inputs may be strided views (K/V sliced out of a packed QKV
projection); only the head dim must be contiguous.

Graph safety: the grid is ``(num_tokens, cdiv(kv_heads, BLOCK_H))`` — shapes only; the slot is
read on the device and a negative one makes the program return.

FP8 cache (``torch.float8_e4m3fn`` / ``float8_e5m2``): the kernel writes the cache's bytes,
``quantize_fp8(x * inverse_scale)`` (see :mod:`.fp8`), with the inverse scales read on the
device from the layer's scale row (``kv_scales[2]`` for K, ``kv_scales[3]`` for V): bit for bit
the torch store's bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.fp8 import NO_FP8, cache_bytes, fp8_format, quantize_fp8
from pagedinfer.adapters.kernels.launch import launch
from pagedinfer.adapters.kv_cache import unit_scales

__all__ = ["store_kv_cache"]

# Elements one program copies per tensor: enough work per program, few registers.
_ELEMENTS_PER_PROGRAM = 2048


# The scale row is a view into the runner's [num_layers, 4] table (16-byte aligned rows), or
# an unused stand-in without FP8: not a specialization key either way.
@triton.jit(do_not_specialize=["kv_scales_ptr"])  # type: ignore[untyped-decorator]
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    kv_scales_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_FORMAT: tl.constexpr,  # see fp8.py; 0: the cache has the inputs' float type
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (heads < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    cache_offset = (
        page * stride_cache_block
        + row * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + offs_d[None, :]
    )

    key_offset = token * stride_key_token + heads[:, None] * stride_key_head + offs_d[None, :]
    key = tl.load(key_ptr + key_offset, mask=mask)
    value_offset = token * stride_value_token + heads[:, None] * stride_value_head + offs_d[None, :]
    value = tl.load(value_ptr + value_offset, mask=mask)
    if FP8_FORMAT != 0:
        key = quantize_fp8(key, tl.load(kv_scales_ptr + 2), FP8_FORMAT)
        value = quantize_fp8(value, tl.load(kv_scales_ptr + 3), FP8_FORMAT)
    tl.store(k_cache_ptr + cache_offset, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offset, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write ``key[t]`` / ``value[t]`` (``[T, kv_heads, head_dim]``) to slot ``slot_mapping[t]``.

    Slots ``< 0`` are skipped. Values are converted to the cache dtype; a float8 cache gets
    them quantized with the scale row ``kv_scales`` (unit scales when ``None``; pass the row
    under CUDA-graph capture). Reads no device values on the host, so it may run inside a
    CUDA-graph capture.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert value.shape == key.shape, (key.shape, value.shape)
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), (k_cache.shape, key.shape)
    assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, num_tokens)
    key, value = _head_dim_contiguous(key), _head_dim_contiguous(value)
    assert k_cache.stride(3) == 1, "the cache's head dim must be contiguous"

    fp8 = fp8_format(k_cache.dtype)
    if fp8 != NO_FP8 and kv_scales is None:
        kv_scales = unit_scales(k_cache.device)
    assert kv_scales is None or kv_scales.dtype == torch.float32

    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _ELEMENTS_PER_PROGRAM // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    launch(_store_kv_kernel, grid)(
        key,
        value,
        cache_bytes(k_cache),
        cache_bytes(v_cache),
        slot_mapping,
        kv_scales if kv_scales is not None else slot_mapping,  # unused without FP8
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        FP8_FORMAT=fp8,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


def _head_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
