"""GPT-OSS's clamped SwiGLU in one launch, on its interleaved ``[..., 2I]`` gate/up tensor.

Even columns are the gate, odd ones the up projection (transformers' ``gate_up[..., ::2]``,
``gate_up[..., 1::2]``)::

    gate = min(gate, limit);  up = clamp(up, -limit, limit)
    out = (up + 1) * gate * sigmoid(alpha * gate)

Torch twin (the test oracle and the CPU path): ``clamped_swiglu`` in
:mod:`pagedinfer.adapters.layers.gpt_oss_moe`, which rounds after every op in the input
dtype; the kernel computes in float32 and rounds once.

Tiling: program ``(row, block)`` handles ``BLOCK`` consecutive output columns of one row
(it reads the ``2 * BLOCK`` interleaved inputs they come from).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.silu_and_mul import launch_gated

__all__ = ["clamped_swiglu"]


@triton.jit  # type: ignore[untyped-decorator]
def _clamped_swiglu_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    x_ptr,
    stride_x,
    stride_out,
    alpha,
    limit,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    gate = tl.load(x_ptr + row * stride_x + 2 * offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    glu = gate / (1.0 + tl.exp(-alpha * gate))
    out = (up + 1.0) * glu
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``[..., 2I]`` interleaved gate/up -> ``[..., I]`` (see the module docstring)."""
    return launch_gated(_clamped_swiglu_kernel, x, float(alpha), float(limit))
