"""``x W^T`` with an FP8 (e4m3) weight and float32 block scales, in one Triton GEMM.

``W [N, K]`` is stored as ``float8_e4m3fn`` with one scale per ``block_n x block_k`` block
(``scale [ceil(N / block_n), ceil(K / block_k)]``; per-channel scales are blocks of
``1 x K``). Each program computes a ``BLOCK_M x BLOCK_N`` tile of the output: it walks K in
steps of ``BLOCK_K`` (which divides ``block_k``, so a step lies in one block column), loads
the FP8 weight tile, widens it to the activations' dtype (exact: every e4m3 value is a
float16 / bfloat16 value), multiplies, and adds the product times the tile columns' scales
to a float32 accumulator. Activations are not quantized (W8A16): the weight bytes read, which
bound decoding, are those of the FP8 weight.

Decode has few rows, so a layer with few output tiles would leave most SMs idle: the K range
is then split over ``split_k`` programs per tile (float32 partial sums, added afterwards).

Torch twin (the test oracle): ``dequantize_fp8`` (``adapters/quantization/fp8.py``) then
``F.linear``. The float32 path (the interpreter) multiplies in IEEE float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.launch import launch
from pagedinfer.adapters.kernels.split_k import plan_split_k, sum_splits
from pagedinfer.adapters.kernels.target import kernel_target

__all__ = ["fp8_gemm", "fp8_gemm_blocks"]


@triton.jit  # type: ignore[untyped-decorator]
def _fp8_gemm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    w_ptr,
    s_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_cs,
    stride_cm,
    k_per_split,
    QUANT_N,
    QUANT_K,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (k_begin + offs_k)[None, :]
    # W is [N, K] (a linear weight); the tile read is W^T: [BLOCK_K, BLOCK_N].
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_begin + offs_k)[:, None]
    s_ptrs = s_ptr + (offs_n // QUANT_N) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_mask = offs_k < k_end - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        scale = tl.load(s_ptrs + (k0 // QUANT_K) * stride_sk, mask=n_mask, other=0.0)
        w = w.to(a.dtype)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee") * scale[None, :]
        else:
            acc += tl.dot(a, w) * scale[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    c_ptrs = c_ptr + pid_s * stride_cs + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_gemm_blocks(block_k: int, k: int) -> int | None:
    """The K step of the kernel for scale blocks of ``block_k`` input features: the largest
    of 128, 64, 32, 16 that divides ``block_k`` (any, when one block spans all ``k``), or
    None when none does (the weight is then dequantized instead)."""
    if block_k >= k:
        return 64
    for step in (128, 64, 32, 16):
        if block_k % step == 0:
            return step
    return None


# Shared memory per block below which float32 activations get two pipeline stages, not
# three: with 64 x 64 x 128 tiles three take 112 KiB (the GPU preflight's figure), more
# than sm_86 / sm_89 have (99 KiB); 16-bit activations take 24 KiB.
_SMALL_SHARED_MEMORY = 128 * 1024


def _num_stages(x: torch.Tensor) -> int:
    target = kernel_target(x.device)
    small = target is not None and target.shared_memory < _SMALL_SHARED_MEMORY
    return 2 if small and x.dtype == torch.float32 else 3


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_n: int,
    block_k: int,
    split_k: int | None = None,
) -> torch.Tensor:
    """``x [..., K] @ dequant(weight [N, K])^T -> [..., N]`` in ``x``'s dtype.

    ``scale [ceil(N / block_n), ceil(K / block_k)]`` float32. ``split_k`` overrides the
    split of the K range (tests); by default it is chosen from the shape and the GPU.
    """
    n, k = int(weight.shape[0]), int(weight.shape[1])
    assert x.shape[-1] == k, (x.shape, weight.shape)
    assert scale.shape == (-(-n // block_n), -(-k // block_k)), (scale.shape, n, k)
    step = fp8_gemm_blocks(block_k, k)
    assert step is not None, f"block_k={block_k} is not a multiple of 16"
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    assert weight.stride(1) == 1 and scale.dtype == torch.float32
    m = int(rows.shape[0])
    if m == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    plan = plan_split_k(x, m, n, k, step, split_k)
    out = plan.out
    launch(_fp8_gemm_kernel, plan.grid)(
        rows,
        weight,
        scale,
        out,
        m,
        n,
        k,
        rows.stride(0),
        weight.stride(0),
        scale.stride(0),
        scale.stride(1),
        out.stride(0),
        out.stride(1),
        plan.k_per_split,
        block_n,
        block_k if block_k < k else k,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=step,
        num_warps=4,
        num_stages=_num_stages(x),
    )
    return sum_splits(plan, x, n)
