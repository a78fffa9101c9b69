"""The batched LoRA matmuls: each token through its own adapter's ``A`` then ``B``.

Punica's pair (S-LoRA, vLLM): *shrink* ``s[t] = A[slot[t]] @ x[t]`` (``[T, in] -> [T, r]``) and
*expand* ``y[t] += B[slot[t]] @ s[t]`` (``[T, r] -> [T, out]``), for a step whose tokens
belong to different adapters (``slot[t]`` the device slot of token ``t``'s adapter; ``-1``:
the base model, which adds nothing). The adapters' weights are stacked by slot,
``A: [S, r, in]`` and ``B: [S, r, out]`` (``B`` transposed from PEFT's ``[out, r]``, the
adapter's scaling folded in; smaller ranks padded with zeros), so that ``slot`` is data on
the device: a captured CUDA graph replays any mix of adapters.

These are the torch twins: each computes every slot's product for every token (one GEMM over
``S * r`` columns) and keeps the token's own, which costs ``S`` times the work of the
per-token kernels but is exact, capturable and runs on every device.
"""

from __future__ import annotations

import torch

__all__ = ["lora_expand", "lora_shrink", "slot_mask"]


def slot_mask(slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, S]``: 1 where token ``t``'s slot is ``s``, else 0 (a base token's row is 0)."""
    wanted = torch.arange(num_slots, device=slots.device)
    return (slots[:, None] == wanted[None, :]).to(dtype)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[T, r]``: ``A[slot[t]] @ x[t]`` for each token (``mask`` from :func:`slot_mask`;
    ``a``: ``[S, r, in]``)."""
    num_slots, rank, in_features = a.shape
    every = x @ a.reshape(num_slots * rank, in_features).t()  # [T, S * r]
    own = every.view(-1, num_slots, rank) * mask[:, :, None]
    return own.sum(dim=1)


def lora_expand(
    y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``y[t] += B[slot[t]] @ s[t]`` in place (``b``: ``[S, r, out]``); returns ``y``."""
    num_slots, rank, out_features = b.shape
    spread = (s[:, None, :] * mask[:, :, None]).reshape(-1, num_slots * rank)
    y += spread @ b.reshape(num_slots * rank, out_features)
    return y
