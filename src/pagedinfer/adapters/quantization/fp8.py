"""FP8 (e4m3) weights with float32 scales: what both FP8 formats share.

A weight ``W [N, K]`` is stored as ``q = W / s`` rounded to ``float8_e4m3fn`` and read back
as ``q * s``. The scale ``s`` is one float per block of ``block_n x block_k`` weights:

* block-wise (``quant_method: fp8``, Qwen3-*-FP8, DeepSeek-V3): ``weight_scale_inv
  [ceil(N / 128), ceil(K / 128)]`` for 128 x 128 blocks; the name is DeepSeek's, the value
  is the multiplier (``W = q * weight_scale_inv``); a partial last block has its own scale;
* per channel (compressed-tensors ``strategy: channel``): ``weight_scale [N, 1]``, one scale
  per output row: a block of ``1 x K``.

:class:`Fp8LinearMethod` holds the FP8 weight and its scales. With kernels (the Triton and
flash paths, on a GPU of compute capability 8.9 or newer, or the CPU under Triton's
interpreter) the layer keeps them and runs :func:`~pagedinfer.adapters.kernels.fp8_gemm.fp8_gemm`,
which reads the FP8 weight and multiplies each block's partial product by its scale
(activations stay in the model's dtype: W8A16); otherwise the weight is dequantized once at
load into the model's dtype.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence

import torch

from pagedinfer.adapters.quantization.base import (
    Axis,
    LinearGeometry,
    LinearQuantMethod,
    QuantizedMatmul,
    TensorSpec,
)

__all__ = [
    "FP8_DTYPE",
    "FP8_KERNEL_MIN_CAPABILITY",
    "FP8_MAX",
    "SCALE_CHECKPOINT_DTYPES",
    "Fp8LinearMethod",
    "Fp8Matmul",
    "dequantize_fp8",
    "fp8_kernel_available",
    "quantize_fp8",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALE_CHECKPOINT_DTYPES: frozenset[str] = frozenset({"F32", "BF16", "F16"})


def _expand(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Each block's scale repeated over its ``block_n x block_k`` weights, cropped."""
    block_n, block_k = block
    return scale.repeat_interleave(block_n, 0)[:rows].repeat_interleave(block_k, 1)[:, :cols]


def quantize_fp8(
    weight: torch.Tensor,
    block: tuple[int, int] | None,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [N, K]`` -> ``(q float8_e4m3fn [N, K], scale)`` as the published tools write
    them: the scale of a block is its largest magnitude / 448 (at least 1e-4 / 448), stored
    in ``scale_dtype``, and ``q = W / scale`` rounded to nearest. ``block`` is
    ``(block_n, block_k)``, or None for one scale per output row (``[N, 1]``)."""
    rows, cols = weight.shape
    block_n, block_k = block if block is not None else (1, cols)
    full = weight.float()
    padded = torch.zeros(
        -(-rows // block_n) * block_n, -(-cols // block_k) * block_k, dtype=torch.float32
    )
    padded[:rows, :cols] = full
    blocks = padded.view(padded.shape[0] // block_n, block_n, padded.shape[1] // block_k, block_k)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-4)
    scale = (amax / FP8_MAX).to(scale_dtype)
    expanded = _expand(scale.float(), rows, cols, (block_n, block_k))
    quantized = (full / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def dequantize_fp8(
    quantized: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """``q * scale`` in float32 (the inverse of :func:`quantize_fp8`, up to FP8 rounding)."""
    rows, cols = quantized.shape
    block_n, block_k = block if block is not None else (1, cols)
    return quantized.float() * _expand(scale.float(), rows, cols, (block_n, block_k))


FP8_KERNEL_MIN_CAPABILITY = (8, 9)
"""The oldest GPU the FP8 GEMM runs on (the GPU preflight skips older targets by it)."""


def fp8_kernel_available(device: torch.device) -> bool:
    """Whether :func:`~pagedinfer.adapters.kernels.fp8_gemm.fp8_gemm` runs on ``device``:
    Triton converts e4m3 on compute capability 8.9+ (Ada, Hopper, Blackwell); on the CPU only
    its interpreter runs kernels (tests)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= FP8_KERNEL_MIN_CAPABILITY
    if device.type == "cpu":
        kernels = importlib.import_module("pagedinfer.adapters.kernels")
        return bool(kernels.interpreter_enabled())
    return False


class Fp8Matmul(QuantizedMatmul):
    """``x W^T`` from the FP8 weight and its block (or channel) scales (see the module doc)."""

    def __init__(
        self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
    ) -> None:
        super().__init__()
        self.block_n, self.block_k = block if block is not None else (1, weight.shape[1])
        self.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale.float().contiguous(), requires_grad=False)
        self._gemm = importlib.import_module("pagedinfer.adapters.kernels.fp8_gemm").fp8_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._gemm(
            x, self.weight, self.weight_scale, block_n=self.block_n, block_k=self.block_k
        )
        return out


class Fp8LinearMethod(LinearQuantMethod):
    """An FP8 weight plus ``scale_suffix`` scales per ``block`` (None: per output channel)."""

    def __init__(
        self,
        names: Sequence[str],
        *,
        kernels: bool,
        block: tuple[int, int] | None,
        scale_suffix: str,
    ) -> None:
        super().__init__(names, kernels=kernels)
        self.block = block
        self.scale_suffix = scale_suffix

    def tensors(self) -> tuple[TensorSpec, ...]:
        if self.block is None:
            scale_axes = (Axis("output"), Axis("input", per_element=None))
            layout = "one scale per output channel ([out, 1])"
        else:
            block_n, block_k = self.block
            scale_axes = (
                Axis("output", per_element=block_n, partial=True),
                Axis("input", per_element=block_k, partial=True),
            )
            layout = f"one scale per {block_n}x{block_k} block of the weight"
        return (
            TensorSpec(
                "weight",
                (Axis("output"), Axis("input")),
                FP8_DTYPE,
                frozenset({"F8_E4M3"}),
                "the FP8 (e4m3) weight",
            ),
            TensorSpec(
                self.scale_suffix, scale_axes, torch.float32, SCALE_CHECKPOINT_DTYPES, layout
            ),
        )

    def finish(
        self, tensors: Mapping[str, torch.Tensor], geometry: LinearGeometry
    ) -> torch.Tensor | QuantizedMatmul:
        weight, scale = tensors["weight"], tensors[self.scale_suffix]
        if self.kernels and fp8_kernel_available(geometry.device):
            return Fp8Matmul(weight, scale, self.block)
        return dequantize_fp8(weight, scale, self.block).to(geometry.dtype)
