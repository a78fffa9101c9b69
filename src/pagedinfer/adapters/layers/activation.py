"""SwiGLU's gate: ``silu(gate) * up`` on a packed ``[gate | up]`` tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SiluAndMul"]


class SiluAndMul(nn.Module):
    """``[..., 2 * d] -> [..., d]``: the first half gated by SiLU times the second half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
