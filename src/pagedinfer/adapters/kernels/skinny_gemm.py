"""``x W^T (+ bias)`` for few rows (decode), with the K range split over several programs.

At decode, a projection with few output features makes few ``[M, N]`` tiles: at 256 rows,
Qwen3-0.6B's o- and down-projections (``N = 1024``) make 16 to 64 tiles for 132 SMs, and a
GEMM that gives each tile one program leaves most of the GPU idle while the weight, which
bounds the step, is read. This kernel splits each tile's K range over several programs
(:mod:`~pagedinfer.adapters.kernels.split_k`: the launch plan and the reduction shared with
the quantized GEMMs), each writing a float32 partial sum; the bias is added once, by the
programs of the first split.

``W [N, K]`` is a linear layer's weight as ``nn.Linear`` stores it (rows contiguous in K).
Each program computes a ``BLOCK_M x BLOCK_N`` tile of the output over its part of K, in
steps of ``BLOCK_K``, with a float32 accumulator; the float32 path (the interpreter)
multiplies in IEEE float32.

:func:`skinny_gemm_wins` is the per-shape choice (a pure function of the shape and the SM
count) and :func:`prefers_skinny_gemm` applies it to tensors: CUDA, float16 / bfloat16, few
rows and fewer output tiles than SMs; everywhere else ``F.linear`` (cuBLAS) runs.

Torch twin (the test oracle): ``F.linear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.launch import launch
from pagedinfer.adapters.kernels.split_k import TILE_N, plan_split_k, row_tile, sum_splits

__all__ = ["BLOCK_K", "MAX_ROWS", "prefers_skinny_gemm", "skinny_gemm", "skinny_gemm_wins"]

BLOCK_K = 64
MAX_ROWS = 256  # above this a GEMM has enough row tiles (and compute) for cuBLAS
_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit  # type: ignore[untyped-decorator]
def _skinny_gemm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    w_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_cs,
    stride_cm,
    k_per_split,
    HAS_BIAS: tl.constexpr,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_mask = offs_k < k_end - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:  # once per output: the first split's programs add it
        bias = tl.load(b_ptr + offs_n, mask=n_mask & (pid_s == 0), other=0.0)
        acc += bias.to(tl.float32)[None, :]
    c_ptrs = c_ptr + pid_s * stride_cs + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def skinny_gemm_wins(rows: int, n: int, k: int, sm_count: int) -> bool:
    """Whether ``rows x K @ (N x K)^T`` should run here rather than in cuBLAS: at most
    :data:`MAX_ROWS` rows (decode), fewer output tiles than SMs (cuBLAS would leave SMs idle
    on a weight-bound GEMM) and at least two K steps to split."""
    if rows < 1 or rows > MAX_ROWS or k <= BLOCK_K:
        return False
    tiles = -(-rows // row_tile(rows)) * -(-n // TILE_N)
    return tiles < sm_count


def prefers_skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """:func:`skinny_gemm_wins` for ``x [..., K]`` and ``weight [N, K]``, on CUDA only and in
    float16 / bfloat16 only (float32 keeps ``F.linear``'s precision settings). No host sync:
    the SM count comes from torch's cached device properties."""
    if x.device.type != "cuda" or x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return False
    if weight.dim() != 2 or weight.stride(1) != 1:
        return False
    n, k = int(weight.shape[0]), int(weight.shape[1])
    rows = x.numel() // k if k else 0
    if not 1 <= rows <= MAX_ROWS:  # prefill: no need to ask for the device's properties
        return False
    sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count
    return skinny_gemm_wins(rows, n, k, sm_count)


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    split_k: int | None = None,
) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]`` in ``x``'s dtype.

    ``split_k`` overrides the split of the K range (tests); by default it is chosen from the
    shape and the GPU (one split off CUDA). The only allocations are the partial-sum buffer
    and the reduction's result, as in the quantized GEMMs (a CUDA graph's pool holds them).
    """
    n, k = int(weight.shape[0]), int(weight.shape[1])
    assert x.shape[-1] == k, (x.shape, weight.shape)
    assert weight.stride(1) == 1, weight.stride()
    assert bias is None or bias.shape == (n,), (None if bias is None else bias.shape, n)
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = int(rows.shape[0])
    if m == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    plan = plan_split_k(x, m, n, k, BLOCK_K, split_k)
    out = plan.out
    launch(_skinny_gemm_kernel, plan.grid)(
        rows,
        weight,
        bias if bias is not None else out,  # never read without a bias
        out,
        m,
        n,
        k,
        rows.stride(0),
        weight.stride(0),
        out.stride(0),
        out.stride(1),
        plan.k_per_split,
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=BLOCK_K,
        num_warps=4,
    )
    return sum_splits(plan, x, n)
