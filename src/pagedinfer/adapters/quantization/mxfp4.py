"""``quant_method: "mxfp4"``: GPT-OSS's released expert weights, dequantized at load.

``config.json``::

    "quantization_config": {"quant_method": "mxfp4",
                            "modules_to_not_convert": ["model.layers.*.self_attn",
                                                       "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"]}

Only the MoE experts are quantized (transformers' ``replace_with_mxfp4_linear`` converts
``mlp.experts`` alone); every other tensor is dense. Each expert projection ``P``
(``gate_up_proj``, ``down_proj``) is stored as two tensors:

* ``P_blocks``, uint8 ``[E, N, K / 32, 16]``: FP4 E2M1 values, two per byte (low nibble
  first), in groups of 32 along the input features ``K``;
* ``P_scales``, uint8 ``[E, N, K / 32]``: one E8M0 exponent per group (bias 127, the group's
  multiplier is ``2 ** (scale - 127)``).

Dequantized, ``P`` is ``[E, N, K]`` transposed to ``[E, K, N]``: the layout of the dense
checkpoint's ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]``, exactly what
transformers' ``convert_moe_packed_tensors`` produces. The loader pairs each ``_blocks`` with
its ``_scales``, dequantizes the pair into the engine's dtype as soon as both are read, and
hands the dense tensor to the parameter's weight loader (tensor-parallel slicing included), so
no second copy of the model is made. The dequantization runs on the CPU, where the tensors
are read; the weight loader copies the result to the parameter's device (CUDA included). There
is no MXFP4 kernel: the model holds dense experts (bf16: about four times MXFP4's bytes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from pagedinfer.adapters.quantization.base import (
    ConfigFields,
    LinearQuantMethod,
    QuantizationConfig,
)
from pagedinfer.errors import UnsupportedModelError

__all__ = [
    "BLOCKS_SUFFIX",
    "FP4_E2M1_VALUES",
    "GROUP_SIZE",
    "SCALES_SUFFIX",
    "Mxfp4Config",
    "dequantize_mxfp4",
    "packed_tensor_name",
]

FP4_E2M1_VALUES: tuple[float, ...] = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
"""The value of each 4-bit E2M1 code (sign bit, two exponent bits, one mantissa bit)."""

GROUP_SIZE = 32
"""Values sharing one E8M0 scale (16 bytes of blocks)."""
SCALE_BIAS = 127
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"


def packed_tensor_name(name: str) -> tuple[str, str] | None:
    """``("...experts.gate_up_proj", "_blocks")`` for an MXFP4 half, else None."""
    for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX):
        if name.endswith(suffix) and ".experts." in name:
            return name.removesuffix(suffix), suffix
    return None


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``blocks [E, N, G, 16]`` + ``scales [E, N, G]`` -> ``[E, G * 32, N]`` in ``dtype``
    (see the module docstring). One expert at a time, so the temporaries stay small."""
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert blocks.dim() == 4 and blocks.shape[:-1] == scales.shape
    experts, rows, groups, width = blocks.shape
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(experts, groups * width * 2, rows, dtype=dtype, device=blocks.device)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    for expert in range(experts):
        packed = blocks[expert]
        values = torch.empty(rows, groups, width * 2, dtype=dtype, device=blocks.device)
        values[..., 0::2] = lut[(packed & 0x0F).long()]
        values[..., 1::2] = lut[(packed >> 4).long()]
        torch.ldexp(values, exponents[expert].unsqueeze(-1), out=values)
        out[expert] = values.reshape(rows, groups * width * 2).T
    return out


@dataclass(frozen=True, slots=True)
class Mxfp4Config(QuantizationConfig):
    """MXFP4 experts (GPT-OSS); no linear layer is quantized."""

    ignore: tuple[str, ...] = ()
    method: ClassVar[str] = "mxfp4"
    architectures: ClassVar[frozenset[str] | None] = frozenset({"GptOssForCausalLM"})

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], path: Path) -> Mxfp4Config:
        fields = ConfigFields(raw, path, "mxfp4")
        return cls(ignore=fields.names("modules_to_not_convert"))

    def describe(self) -> str:
        return "mxfp4 (FP4 E2M1 MoE experts, groups of 32, dequantized at load)"

    def linear_method(self, names: Sequence[str], *, kernels: bool) -> LinearQuantMethod | None:
        return None  # only the experts are quantized; linear layers stay dense

    def make_linear(self, names: Sequence[str], *, kernels: bool) -> LinearQuantMethod:
        raise UnsupportedModelError(
            f"quantization_config (quant_method 'mxfp4') quantizes only MoE experts, not the "
            f"linear layer {', '.join(names)}"
        )
