"""``x W^T`` with a 4-bit weight, group scales and zero points, in one Triton GEMM.

The layout (``adapters/quantization/int4.py`` converts AWQ and GPTQ to it at load):

* ``qweight [K / 8, N]`` int32: input feature ``8 i + j`` of output feature ``n`` in bits
  ``4 j`` of ``qweight[i, n]``;
* ``zeros [groups, N]`` uint8 and ``scales [groups, N]`` float32;
* ``g_idx [K]`` int32: the group (row of ``zeros`` / ``scales``) of every input feature, so
  GPTQ's act-order needs nothing else.

``W[n, k] = (q - zeros[g_idx[k], n]) * scales[g_idx[k], n]``, computed in float32 and
rounded to the activations' dtype (exactly what the dequantized weight of the CPU path
holds), then multiplied on the tensor cores with a float32 accumulator. Each program
computes a ``BLOCK_M x BLOCK_N`` output tile over its part of the K range; every word of
``qweight`` is loaded by the eight rows of the tile that it packs (served from cache), and
each row gathers its group's scales and zero points.

Decode: the K range is split over several programs per tile when there are few tiles
(float32 partial sums, added afterwards), as in ``fp8_gemm``.

Torch twin (the test oracle): ``dequantize_int4`` then ``F.linear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.launch import launch
from pagedinfer.adapters.kernels.split_k import plan_split_k, sum_splits

__all__ = ["int4_gemm"]

_BLOCK_K = 32


@triton.jit  # type: ignore[untyped-decorator]
def _int4_gemm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    q_ptr,
    z_ptr,
    s_ptr,
    g_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_qk,
    stride_zg,
    stride_sg,
    stride_cs,
    stride_cm,
    k_per_split,
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
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        a = tl.load(
            a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        kn_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(
            q_ptr + (offs_k[:, None] // 8).to(tl.int64) * stride_qk + offs_n[None, :],
            mask=kn_mask,
            other=0,
        )
        q = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
        group = tl.load(g_ptr + offs_k, mask=k_mask, other=0).to(tl.int64)
        zero = tl.load(z_ptr + group[:, None] * stride_zg + offs_n[None, :], mask=kn_mask, other=0)
        scale = tl.load(
            s_ptr + group[:, None] * stride_sg + offs_n[None, :], mask=kn_mask, other=0.0
        )
        w = ((q.to(tl.float32) - zero.to(tl.float32)) * scale).to(a.dtype)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    c_ptrs = c_ptr + pid_s * stride_cs + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    *,
    split_k: int | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W^T -> [..., N]`` in ``x``'s dtype (layout in the module docstring).

    ``split_k`` overrides the split of the K range (tests); by default it is chosen from the
    shape and the GPU.
    """
    k, n = int(g_idx.shape[0]), int(qweight.shape[1])
    assert x.shape[-1] == k and qweight.shape[0] * 8 == k, (x.shape, qweight.shape)
    assert zeros.shape == scales.shape and scales.shape[1] == n, (zeros.shape, scales.shape)
    assert zeros.dtype == torch.uint8 and scales.dtype == torch.float32
    assert qweight.stride(1) == 1 and zeros.stride(1) == 1 and scales.stride(1) == 1
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = int(rows.shape[0])
    if m == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    plan = plan_split_k(x, m, n, k, _BLOCK_K, split_k)
    out = plan.out
    launch(_int4_gemm_kernel, plan.grid)(
        rows,
        qweight,
        zeros,
        scales,
        g_idx,
        out,
        m,
        n,
        k,
        rows.stride(0),
        qweight.stride(0),
        zeros.stride(0),
        scales.stride(0),
        out.stride(0),
        out.stride(1),
        plan.k_per_split,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=_BLOCK_K,
        num_warps=4,
    )
    return sum_splits(plan, x, n)
