"""Fused mixture-of-experts: tokens sorted by expert, one grouped GEMM per projection.

Every token picks ``k`` experts, so there are ``P = T * k`` (token, expert) pairs. The torch
reference (:func:`~pagedinfer.adapters.layers.mlp.moe_experts_torch`) loops over the experts
on the host; here the whole block is four launches, none of which waits for the host (so it
can run inside a CUDA graph):

1. :func:`align_by_expert` (torch ops on the device): sort the pairs by expert and pad each
   expert's run to a multiple of ``BLOCK_M``, so that every block of ``BLOCK_M`` sorted rows
   belongs to one expert. Padding rows hold the sentinel ``P``.
2. grouped GEMM ``[P, H] x w13[e]^T -> [P, 2I]``: block ``m`` multiplies its rows (gathered
   from the hidden states, row ``pair // k``) by its expert's ``gate_up`` weight.
3. ``silu(gate) * up`` (the SiLU-and-mul kernel) -> ``[P, I]``.
4. grouped GEMM ``[P, I] x w2[e]^T -> [P, H]``, each row scaled by its routing weight; then the
   ``k`` rows of each token are summed.

GPT-OSS (:func:`fused_gpt_oss_moe`) runs the same steps on its checkpoint layouts (the
grouped GEMM reads ``[E, K, N]`` weights through strides), adds each expert's biases in the
GEMMs' epilogues (the down bias before the routing weight) and applies its clamped SwiGLU to
the interleaved gate/up columns in step 3.

Accumulation is float32; float32 models multiply in IEEE float32 (no TF32). The grid covers
the largest padded size ``P + min(E, P) * (BLOCK_M - 1)``; blocks past the actual padded size
(read from the device) return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.clamped_swiglu import clamped_swiglu
from pagedinfer.adapters.kernels.launch import launch
from pagedinfer.adapters.kernels.silu_and_mul import silu_and_mul

__all__ = ["align_by_expert", "fused_gpt_oss_moe", "fused_moe", "grouped_gemm"]


# num_pairs (tokens x k) changes from step to step: keyed on divisibility by 16 it would
# compile a second variant mid-run (test_kernel_specialization).
@triton.jit(do_not_specialize=["num_pairs"])  # type: ignore[untyped-decorator]
def _grouped_gemm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bias,
    stride_cm,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    valid = pairs < num_pairs
    rows = pairs // TOP_K  # the hidden-state row of each pair
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    # b is [E, N, K] (a linear weight per expert, or a strided view of [E, K, N]); the tile
    # read is W^T: [BLOCK_K, BLOCK_N].
    b_ptrs = (
        b_ptr
        + expert * stride_be
        + offs_n[None, :].to(tl.int64) * stride_bn
        + offs_k[:, None].to(tl.int64) * stride_bk
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:  # the expert's bias, before the routing weight (GPT-OSS)
        bias = tl.load(bias_ptr + expert * stride_bias + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids, expert_ids, num_padded)`` for ``topk_ids [T, k]``, on its device.

    ``sorted_ids [capacity]`` (int32): pair indices ``t * k + j`` grouped by expert, each
    group padded with the sentinel ``T * k`` to a multiple of ``block_m``;
    ``expert_ids [capacity / block_m]`` (int32): the expert of each block;
    ``num_padded [1]`` (int64): how many sorted rows are in use. No host synchronisation.
    """
    device = topk_ids.device
    flat = topk_ids.flatten().to(torch.int64)
    num_pairs = int(flat.numel())
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - (
        torch.cumsum(counts, 0) - counts
    ).index_select(0, sorted_experts)
    destinations = (ends - padded).index_select(0, sorted_experts) + rank_in_expert
    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    capacity *= block_m
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, destinations, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, dtype=torch.int64, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_max_(num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), ends[-1:]


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_padded: torch.Tensor,
    *,
    top_k: int,
    block_m: int,
    weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """``out[p] = (a[p // top_k] @ b[expert(p)]^T + bias[expert(p)]) * weights[p]`` for every
    pair ``p`` (the bias and the weight when given).

    ``a [rows, K]`` with a contiguous last dim; ``b [E, N, K]`` with its last or its middle
    dim contiguous (a linear weight per expert, or ``w.transpose(1, 2)`` of ``w [E, K, N]``);
    ``bias [E, N]`` with a contiguous last dim; ``out [P, N]``.
    """
    num_pairs, n = int(out.shape[0]), int(out.shape[1])
    k = int(a.shape[1])
    assert a.stride(1) == 1 and out.stride(1) == 1 and 1 in (b.stride(1), b.stride(2))
    assert b.shape[1] == n and b.shape[2] == k, (a.shape, b.shape, out.shape)
    assert bias is None or (bias.shape == (b.shape[0], n) and bias.stride(1) == 1), bias
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 32 if k >= 32 else 16
    grid = (int(expert_ids.shape[0]), triton.cdiv(n, block_n))
    launch(_grouped_gemm_kernel, grid)(
        a,
        b,
        out,
        bias if bias is not None else out,  # unused without HAS_BIAS
        weights if weights is not None else out,  # unused without MUL_WEIGHT
        sorted_ids,
        expert_ids,
        num_padded,
        num_pairs,
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        TOP_K=top_k,
        HAS_BIAS=bias is not None,
        MUL_WEIGHT=weights is not None,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts' weighted sum ``[T, H]`` (see the module docstring for the steps).

    ``hidden [T, H]``, ``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``,
    ``topk_weights`` / ``topk_ids [T, k]``: the same contract as the torch reference.
    """
    num_tokens, top_k = int(topk_ids.shape[0]), int(topk_ids.shape[1])
    num_experts, hidden_size = int(w13.shape[0]), int(hidden.shape[1])
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    num_pairs = num_tokens * top_k
    block_m = _block_m(num_pairs, num_experts)
    sorted_ids, expert_ids, num_padded = align_by_expert(topk_ids, num_experts, block_m)
    hidden = hidden.contiguous()
    gate_up = torch.empty(num_pairs, int(w13.shape[1]), dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(
        hidden, w13, gate_up, sorted_ids, expert_ids, num_padded, top_k=top_k, block_m=block_m
    )
    activated = silu_and_mul(gate_up)
    pair_out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(
        activated,
        w2,
        pair_out,
        sorted_ids,
        expert_ids,
        num_padded,
        top_k=1,
        block_m=block_m,
        weights=topk_weights.flatten().contiguous(),
    )
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1)


def fused_gpt_oss_moe(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """GPT-OSS's experts' weighted sum ``[T, H]``: the steps of :func:`fused_moe` with each
    expert's biases in the grouped GEMMs' epilogues and the clamped SwiGLU
    (:func:`~pagedinfer.adapters.kernels.clamped_swiglu.clamped_swiglu`) between them.

    Checkpoint layouts: ``gate_up_proj [E, H, 2I]`` (gate and up interleaved),
    ``gate_up_bias [E, 2I]``, ``down_proj [E, I, H]``, ``down_bias [E, H]`` (``None``: no
    down bias, as on tensor-parallel ranks but the first). The same contract as
    :func:`~pagedinfer.adapters.layers.gpt_oss_moe.gpt_oss_experts_torch`.
    """
    num_tokens, top_k = int(topk_ids.shape[0]), int(topk_ids.shape[1])
    num_experts, hidden_size = int(gate_up_proj.shape[0]), int(hidden.shape[1])
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    num_pairs = num_tokens * top_k
    block_m = _block_m(num_pairs, num_experts)
    sorted_ids, expert_ids, num_padded = align_by_expert(topk_ids, num_experts, block_m)
    hidden = hidden.contiguous()
    gate_up = torch.empty(
        num_pairs, int(gate_up_proj.shape[2]), dtype=hidden.dtype, device=hidden.device
    )
    grouped_gemm(
        hidden, gate_up_proj.transpose(1, 2), gate_up, sorted_ids, expert_ids, num_padded,
        top_k=top_k, block_m=block_m, bias=gate_up_bias,
    )  # fmt: skip
    activated = clamped_swiglu(gate_up, alpha, limit)
    pair_out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(
        activated, down_proj.transpose(1, 2), pair_out, sorted_ids, expert_ids, num_padded,
        top_k=1, block_m=block_m, weights=topk_weights.flatten().contiguous(), bias=down_bias,
    )  # fmt: skip
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1)


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Small batches (decode) spread few rows over many experts: small blocks waste less."""
    return 16 if num_pairs <= 4 * num_experts else 64
