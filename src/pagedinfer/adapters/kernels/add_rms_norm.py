"""RMSNorm, optionally fused with the residual add before it, in one kernel launch.

A pre-norm decoder computes, at every sublayer boundary::

    residual = x + residual                  (in the model dtype)
    normed   = weight * to_dtype(residual / sqrt(mean(residual^2) + eps))

As separate torch ops that is an add, a cast to float32, a square, a mean, an add, an rsqrt,
a multiply, a cast back and the weight multiply: nine launches (seven in float32), each
reading and writing the whole activation. :func:`add_rms_norm` reads ``x`` and ``residual``
once and writes ``normed`` and the new ``residual`` once.

Torch twins (the test oracles and the CPU path): ``add_rms_norm_torch`` and ``rms_norm_torch``
in :mod:`pagedinfer.adapters.layers.norm` (a torch-only module: the CPU path never imports
Triton). Numerics follow them, and Hugging Face's RMSNorm: the sum
is rounded to the model dtype before the statistics, the statistics are float32, the
normalised value is rounded to the model dtype *before* the weight multiplies it, and that
product is rounded again. Only the order of the float32 sum of squares differs.

Tiling: one program per row (token), the hidden size padded to a power of two and masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.launch import launch

__all__ = ["add_rms_norm", "rms_norm"]


@triton.jit  # type: ignore[untyped-decorator]
def _add_rms_norm_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)
        # The sum as the model dtype holds it: the statistics are taken of what is stored.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / HIDDEN
    normed = (xf * tl.math.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = int(x.shape[-1])
    assert weight.shape == (hidden,), (weight.shape, x.shape)
    rows = x.reshape(-1, hidden)
    assert rows.stride(-1) == 1, "the hidden dim must be contiguous"
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out_rows = out.view(-1, hidden)
    if residual is None:
        residual_rows = residual_out_rows = rows  # unused by the kernel
        residual_out = x
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual, x)
        residual_rows = residual.reshape(-1, hidden)
        assert residual_rows.stride(-1) == 1, "the hidden dim must be contiguous"
        residual_out = torch.empty_like(x)
        residual_out_rows = residual_out.view(-1, hidden)
    num_rows = int(rows.shape[0])
    if num_rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    launch(_add_rms_norm_kernel, (num_rows,))(
        out_rows,
        residual_out_rows,
        rows,
        residual_rows,
        weight,
        eps,
        rows.stride(0),
        residual_rows.stride(0),
        out_rows.stride(0),
        residual_out_rows.stride(0),
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 256, 1), 16),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (one launch). ``x`` may be a row-strided view."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual' = x + residual``; returns ``(rms_norm(residual'), residual')`` (one launch).

    Both results are new tensors; the inputs are not modified.
    """
    return _launch(x, residual, weight, eps)
