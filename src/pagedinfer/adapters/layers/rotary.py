"""Rotary position embedding (neox / ``rotate_half`` layout) with a float32 cos/sin cache.

:func:`apply_rotary` and :func:`qk_norm_rope_torch` are the torch twins of the Triton kernel in
:mod:`pagedinfer.adapters.kernels.qk_norm_rope`, which does the per-head q/k RMSNorm, the
rotation and the KV store in one launch (the CPU path runs the twins; the kernel tests use them
as the oracle).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedinfer.adapters.layers.norm import rms_norm_torch

__all__ = ["RotaryEmbedding", "apply_rotary", "qk_norm_rope_torch"]


class RotaryEmbedding(nn.Module):
    """Precomputed ``cos`` / ``sin`` of ``position * theta^(-2i/d)`` for every position.

    The tables are float32 whatever the model dtype: angles of large positions lose their
    low bits in bf16. The model looks them up once per step (:meth:`forward`) and every layer
    applies them with :func:`apply_rotary`.
    """

    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        # Same float32 arithmetic as transformers' default RoPE, so the angles are identical.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv_freq = 1.0 / (base**exponents)
        positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[T, 1, head_dim / 2]`` for ``positions [T]``."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]``: halves ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``.

    Computed in float32 and cast back to ``x``'s dtype.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def qk_norm_rope_torch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` from the packed projection ``qkv [T, (H + 2 KV) * D]``: per-head RMSNorm
    of q and k when weights are given (Qwen3), then the rotation with this step's ``cos`` /
    ``sin`` (``[T, 1, D / 2]``, from :meth:`RotaryEmbedding.forward`)."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    if q_weight is not None and k_weight is not None:
        q = rms_norm_torch(q, q_weight, eps)
        k = rms_norm_torch(k, k_weight, eps)
    return (
        apply_rotary(q, cos, sin),
        apply_rotary(k, cos, sin),
        v.view(num_tokens, num_kv_heads, head_dim),
    )
