"""Gated MLP activations on a packed ``[gate | up]`` tensor: SwiGLU's ``silu(gate) * up``
and Gemma's ``gelu_tanh(gate) * up``.

:func:`silu_and_mul_torch` is the torch twin of the Triton kernel in
:mod:`pagedinfer.adapters.kernels.silu_and_mul` (the CPU path and the kernel tests' oracle).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GeluTanhAndMul", "SiluAndMul", "gated_activation", "silu_and_mul_torch"]


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * d] -> [..., d]``: the first half gated by SiLU times the second half."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """``[..., 2 * d] -> [..., d]``; ``fused=True`` runs the Triton kernel (one launch)."""

    def __init__(self, *, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self._op: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_torch
        if fused:
            from pagedinfer.adapters.kernels.silu_and_mul import silu_and_mul

            self._op = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x)


def gelu_tanh_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * d] -> [..., d]``: GELU (tanh approximation) of the first half times the
    second half (Gemma's ``gelu_pytorch_tanh`` gate)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GeluTanhAndMul(nn.Module):
    """``[..., 2 * d] -> [..., d]`` with a GELU-tanh gate; torch ops on every device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul_torch(x)


def gated_activation(name: str, *, fused: bool = False) -> nn.Module:
    """The gate of a gated MLP by ``config.json``'s ``hidden_act`` name."""
    if name == "silu":
        return SiluAndMul(fused=fused)
    assert name == "gelu_pytorch_tanh", f"unchecked activation {name!r}"
    return GeluTanhAndMul()
