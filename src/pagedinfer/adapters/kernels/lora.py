"""Punica's BGMV pair for batched LoRA: every token through its own adapter, one launch each.

``lora_shrink_kernel``: ``s[t] = A[slot[t]] @ x[t]`` (``[T, in] -> [T, R]``, ``A: [S, R, in]``);
``lora_expand_kernel``: ``y[t] += B[slot[t]] @ s[t]`` (``B: [S, r, out]``, ``y`` a column slice of
a projection's output). ``slot[t] < 0`` is the base model: shrink writes zeros, expand adds
nothing. The slots are read on the device, so a captured CUDA graph replays any mix of
adapters. Unlike the torch twins (:mod:`pagedinfer.adapters.lora.ops`, which compute every
slot's product and keep the token's own), each token reads only its own adapter's weights.

Tiling: shrink program ``(t, rb)`` computes ``BLOCK_R`` ranks of token ``t``, walking ``in`` in
``BLOCK_K`` steps; expand program ``(t, nb)`` computes ``BLOCK_N`` output columns of token
``t`` from its whole rank (``BLOCK_R >= r``). Accumulation in float32; the shrink's result is
stored in ``x``'s dtype, as the twin's GEMM returns it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.launch import launch

__all__ = ["lora_expand_triton", "lora_shrink_triton"]

_BLOCK_K = 128
_BLOCK_N = 128


@triton.jit  # type: ignore[untyped-decorator]
def _lora_shrink_kernel(  # type: ignore[no-untyped-def]
    s_ptr,
    x_ptr,
    a_ptr,
    slots_ptr,
    stride_x,
    stride_s,
    stride_a_slot,
    stride_a_rank,
    RANKS: tl.constexpr,
    IN_FEATURES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_mask = ranks < RANKS
    slot = tl.load(slots_ptr + token)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + ranks[:, None] * stride_a_rank
        for start in range(0, IN_FEATURES, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            col_mask = cols < IN_FEATURES
            x = tl.load(x_ptr + token * stride_x + cols, mask=col_mask, other=0.0)
            a = tl.load(
                a_rows + cols[None, :], mask=rank_mask[:, None] & col_mask[None, :], other=0.0
            )
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(s_ptr + token * stride_s + ranks, acc.to(s_ptr.dtype.element_ty), mask=rank_mask)


@triton.jit  # type: ignore[untyped-decorator]
def _lora_expand_kernel(  # type: ignore[no-untyped-def]
    y_ptr,
    s_ptr,
    b_ptr,
    slots_ptr,
    stride_y,
    stride_s,
    stride_b_slot,
    stride_b_rank,
    RANK: tl.constexpr,
    OUT_FEATURES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < OUT_FEATURES
        ranks = tl.arange(0, BLOCK_R)
        rank_mask = ranks < RANK
        s = tl.load(s_ptr + token * stride_s + ranks, mask=rank_mask, other=0.0)
        b = tl.load(
            b_ptr
            + slot.to(tl.int64) * stride_b_slot
            + ranks[:, None] * stride_b_rank
            + cols[None, :],
            mask=rank_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc = tl.sum(b.to(tl.float32) * s.to(tl.float32)[:, None], axis=0)
        y_ptrs = y_ptr + token * stride_y + cols
        y = tl.load(y_ptrs, mask=col_mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=col_mask)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[T, R]``: ``A[slot[t]] @ x[t]`` (zeros where ``slot[t] < 0``); ``a``: ``[S, R, in]``."""
    num_tokens, in_features = x.shape
    ranks = int(a.shape[1])
    assert a.shape[2] == in_features and x.stride(1) == 1 and a.stride(2) == 1, (x.shape, a.shape)
    s = torch.empty((num_tokens, ranks), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return s
    block_r = min(64, triton.next_power_of_2(ranks))
    block_k = min(_BLOCK_K, triton.next_power_of_2(in_features))
    launch(_lora_shrink_kernel, (num_tokens, triton.cdiv(ranks, block_r)))(
        s,
        x,
        a,
        slots,
        x.stride(0),
        s.stride(0),
        a.stride(0),
        a.stride(1),
        RANKS=ranks,
        IN_FEATURES=in_features,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
    )
    return s


def lora_expand_triton(
    y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """``y[t] += B[slot[t]] @ s[t]`` in place (nothing where ``slot[t] < 0``); ``b``:
    ``[S, r, out]``, ``s``: ``[T, r]`` (a column slice is fine); returns ``y``."""
    num_tokens, out_features = y.shape
    rank = int(b.shape[1])
    assert b.shape[2] == out_features and s.shape[1] == rank, (y.shape, s.shape, b.shape)
    assert y.stride(1) == 1 and s.stride(1) == 1 and b.stride(2) == 1
    if num_tokens == 0:
        return y
    block_n = min(_BLOCK_N, triton.next_power_of_2(out_features))
    launch(_lora_expand_kernel, (num_tokens, triton.cdiv(out_features, block_n)))(
        y,
        s,
        b,
        slots,
        y.stride(0),
        s.stride(0),
        b.stride(0),
        b.stride(1),
        RANK=rank,
        OUT_FEATURES=out_features,
        BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_N=block_n,
    )
    return y
