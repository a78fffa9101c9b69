"""SwiGLU's gate in one launch: ``silu(gate) * up`` on a packed ``[..., gate | up]`` tensor.

As torch ops it is a SiLU and a multiply over views of the packed projection (two launches,
and the intermediate ``silu(gate)`` makes a round trip through memory); the kernel reads each
input element once and writes the output once.

Torch twin (the test oracle and the CPU path): ``silu_and_mul_torch`` in
:mod:`pagedinfer.adapters.layers.activation`. Numerics follow it: SiLU in float32 rounded to
the input dtype (what ``F.silu`` returns), then the product rounded again.

Tiling: program ``(row, block)`` handles ``BLOCK`` consecutive output columns of one row.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.launch import launch

__all__ = ["launch_gated", "silu_and_mul"]

_BLOCK = 1024


@triton.jit  # type: ignore[untyped-decorator]
def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    x_ptr,
    stride_x,
    stride_out,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + WIDTH + offs, mask=mask, other=0.0)
    gate_f = gate.to(tl.float32)
    silu = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * d] -> [..., d]``: ``silu(x[..., :d]) * x[..., d:]`` in one launch."""
    return launch_gated(_silu_and_mul_kernel, x)


def launch_gated(kernel: Any, x: torch.Tensor, *scalars: float) -> torch.Tensor:
    """``[..., 2 * d] -> [..., d]`` through a gated-activation ``kernel`` over its rows:
    ``kernel(out, x, stride_x, stride_out, *scalars, WIDTH=d, BLOCK=...)`` on the grid
    ``(rows, cdiv(d, BLOCK))`` (this module's kernel, and GPT-OSS's clamped SwiGLU)."""
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
    launch(kernel, (num_rows, triton.cdiv(width, block)))(
        out_rows,
        rows,
        rows.stride(0),
        out_rows.stride(0),
        *scalars,
        WIDTH=width,
        BLOCK=block,
        num_warps=4,
    )
    return out
