"""RMSNorm, identical to Hugging Face's ``LlamaRMSNorm`` / ``Qwen3RMSNorm``, and its fused variants.

The functions here are the torch twins of the Triton kernels in
:mod:`pagedinfer.adapters.kernels.add_rms_norm`: the CPU path runs them, and the kernel tests
use them as the oracle. This module never imports Triton; a layer built with ``fused=True``
imports the kernel when it is constructed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["RMSNorm", "add_rms_norm_torch", "rms_norm_torch"]


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dimension.

    The statistics are computed in float32 and the normalised value is cast back to the input
    dtype *before* the weight multiplies it, exactly as transformers does, so that greedy
    outputs match it bit for bit in float32 and as closely as possible in bf16.
    """
    input_dtype = x.dtype
    xf = x if input_dtype == torch.float32 else x.to(torch.float32)  # no call when it is
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = xf * variance.add_(eps).rsqrt_()  # in place: the same ops, two fewer tensors
    return weight * (normed if input_dtype == torch.float32 else normed.to(input_dtype))


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, the sum rounded to the model dtype first."""
    summed = x + residual
    return rms_norm_torch(summed, weight, eps), summed


_Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
_AddNorm = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (see :func:`rms_norm_torch` for the arithmetic).

    ``fused=True`` runs the Triton kernels (one launch per call, also for
    :meth:`add_and_norm`); the default runs the torch twins.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self._norm: _Norm = rms_norm_torch
        self._add_norm: _AddNorm = add_rms_norm_torch
        if fused:
            from pagedinfer.adapters.kernels.add_rms_norm import add_rms_norm, rms_norm

            self._norm, self._add_norm = rms_norm, add_rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm residual step: ``(norm(x + residual), x + residual)``, new tensors."""
        return self._add_norm(x, residual, self.weight, self.eps)
