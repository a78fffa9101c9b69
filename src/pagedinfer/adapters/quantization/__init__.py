"""Quantized checkpoints: FP8 block-wise, compressed-tensors FP8, AWQ and GPTQ 4-bit.

A map of the package:

* :mod:`.base` — what a method provides: a :class:`~.base.QuantizationConfig` (parsed from
  ``quantization_config``, decides which linear layers are quantized) and, per layer, a
  :class:`~.base.LinearQuantMethod` (its checkpoint tensors, axis by axis, and what it
  computes once they are loaded);
* :mod:`.config` — ``quant_method`` -> the method's parser; refuses unknown methods;
* :mod:`.fp8` — FP8 (e4m3) weights with block or channel scales, shared by
  :mod:`.fp8_block` (``quant_method: fp8``, Qwen3-*-FP8) and :mod:`.compressed_tensors`
  (llm-compressor's FP8);
* :mod:`.int4` — 4-bit weights with group scales and zero points, shared by :mod:`.awq`
  (AutoAWQ GEMM) and :mod:`.gptq` (GPTQ, with or without act-order).
* :mod:`.mxfp4` — GPT-OSS's MXFP4 experts (``quant_method: mxfp4``), no linear layer: the
  loader dequantizes each ``_blocks`` / ``_scales`` pair at load (on the CPU, for a model on
  any device).

``adapters/models/quantized_checkpoint.py`` writes checkpoints in each published format
(tests and benchmarks quantize random-weight checkpoints with it).

On the torch path (the CPU) every quantized layer is dequantized once at load into the
model's dtype: correct, not faster or smaller than the dense model. On the Triton and flash
paths the layers keep their quantized tensors and run the GEMM kernels of
``adapters/kernels/fp8_gemm.py`` and ``int4_gemm.py``.
"""

from __future__ import annotations

from pagedinfer.adapters.quantization.base import LinearQuantMethod, QuantizationConfig
from pagedinfer.adapters.quantization.config import SUPPORTED_METHODS, parse_quantization_config

__all__ = [
    "SUPPORTED_METHODS",
    "LinearQuantMethod",
    "QuantizationConfig",
    "linear_method",
    "parse_quantization_config",
]


def linear_method(
    config: QuantizationConfig | None, *names: str, kernels: bool
) -> LinearQuantMethod | None:
    """The quantization of the linear layer built from checkpoint modules ``names``, or
    ``None`` (an unquantized checkpoint, or a module the config leaves dense)."""
    if config is None:
        return None
    return config.linear_method(names, kernels=kernels)
