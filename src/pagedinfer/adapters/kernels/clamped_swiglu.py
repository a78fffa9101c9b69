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

from pagedinfer.adapters.kernels.launch import launch

__all__ = ["clamped_swiglu"]

_BLOCK = 1024


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
    width = int(x.shape[-1]) // 2
    assert x.shape[-1] == 2 * width, x.shape
    rows = x.reshape(-1, 2 * width)
    assert rows.stride(-1) == 1, "the last dim must be contiguous"
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, width)
    num_rows = int(rows.shape[0])
    if num_rows == 0 or width == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(width))
    launch(_clamped_swiglu_kernel, (num_rows, triton.cdiv(width, block)))(
        out_rows,
        rows,
        rows.stride(0),
        out_rows.stride(0),
        float(alpha),
        float(limit),
        WIDTH=width,
        BLOCK=block,
        num_warps=4,
    )
    return out
