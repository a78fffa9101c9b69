"""``quant_method: "fp8"`` with ``weight_block_size``: Qwen3-*-FP8, DeepSeek-V3 style.

``config.json``::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

Every linear layer of the decoder stores ``<module>.weight`` (``F8_E4M3 [N, K]``) and
``<module>.weight_scale_inv`` (float ``[ceil(N / 128), ceil(K / 128)]``, the multiplier of
each 128 x 128 block); embeddings, norms and the LM head stay in the model's dtype. Modules
named in ``modules_to_not_convert`` (transformers) or ``ignored_layers`` (vLLM) stay dense.

Refused, with the field named: another ``fmt`` (e5m2), ``activation_scheme: "static"``
(checkpoints with ``input_scale`` tensors) and per-tensor FP8 (no ``weight_block_size``).
``activation_scheme: "dynamic"`` means activations are quantized on the fly by engines that
multiply in FP8; pagedinfer keeps activations in the model's dtype (see ``fp8.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pagedinfer.adapters.quantization.base import (
    ConfigFields,
    LinearQuantMethod,
    QuantizationConfig,
)
from pagedinfer.adapters.quantization.fp8 import Fp8LinearMethod

__all__ = ["Fp8BlockConfig"]


@dataclass(frozen=True, slots=True)
class Fp8BlockConfig(QuantizationConfig):
    """Block-wise FP8: ``weight_block_size = (block_n, block_k)``."""

    weight_block_size: tuple[int, int]
    ignore: tuple[str, ...] = ()
    method: ClassVar[str] = "fp8"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], path: Path) -> Fp8BlockConfig:
        fields = ConfigFields(raw, path, "fp8")
        fmt = fields.get("fmt", default="e4m3")
        if fmt != "e4m3":
            fields.fail(f"fmt={fmt!r} is not supported: expected 'e4m3'")
        scheme = fields.get("activation_scheme", default="dynamic")
        if scheme != "dynamic":
            fields.fail(
                f"activation_scheme={scheme!r} is not supported: expected 'dynamic' (static "
                "activation scales, input_scale tensors, are not implemented)"
            )
        block = fields.get("weight_block_size", default=None)
        if block is None:
            fields.fail(
                "has no weight_block_size: per-tensor FP8 checkpoints are not supported, "
                "expected block-wise FP8 such as weight_block_size [128, 128]"
            )
        if (
            not isinstance(block, list)
            or len(block) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block)
        ):
            fields.fail(
                f"weight_block_size={block!r} is invalid: expected two positive integers "
                "[block_n, block_k]"
            )
        scale_fmt = fields.get("scale_fmt", default=None)
        if scale_fmt not in (None, "ue8m0"):
            fields.fail(f"scale_fmt={scale_fmt!r} is not supported: expected none or 'ue8m0'")
        return cls(
            weight_block_size=(block[0], block[1]),
            ignore=fields.names("modules_to_not_convert", "ignored_layers"),
        )

    def describe(self) -> str:
        block_n, block_k = self.weight_block_size
        return f"fp8 (e4m3 weights, {block_n}x{block_k} blocks)"

    def make_linear(self, names: Sequence[str], *, kernels: bool) -> LinearQuantMethod:
        return Fp8LinearMethod(
            names, kernels=kernels, block=self.weight_block_size, scale_suffix="weight_scale_inv"
        )
