"""``quant_method: "compressed-tensors"`` FP8 (llm-compressor's ``FP8_DYNAMIC`` and friends).

``config.json``::

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": true, "dynamic": false,
                    "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": true,
                              "dynamic": true, "strategy": "token"}}},
      "ignore": ["lm_head"]}

Each quantized module stores ``<module>.weight`` (``F8_E4M3 [N, K]``) and
``<module>.weight_scale`` (``[N, 1]``, one scale per output channel; ``strategy: "block"``
with ``block_structure [bn, bk]``: one per block, ``[ceil(N / bn), ceil(K / bk)]``).
``ignore`` lists modules (names or ``re:`` regexes) left dense. With a ``kv_cache_scheme``
(FP8, one static scale per tensor) each layer also stores ``self_attn.k_scale`` and
``v_scale``: the loader hands them to the FP8 KV cache.

Supported: FP8 weights with channel or block scales, activations dynamic (any strategy: they
are not quantized here, see ``fp8.py``) or absent (W8A16). Refused, naming the field: more
than one config group, targets other than ``Linear``, integer or 4-bit weights, per-tensor or
per-group weight scales, static (``dynamic: false``) input activations, output activations,
sparsity and transforms.
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

__all__ = ["CompressedTensorsFp8Config"]

_FORMATS = ("float-quantized", None)


@dataclass(frozen=True, slots=True)
class CompressedTensorsFp8Config(QuantizationConfig):
    """FP8 weights with per-channel (``block=None``) or per-block scales."""

    block: tuple[int, int] | None
    dynamic_activations: bool  # False: weight-only (no input_activations)
    ignore: tuple[str, ...] = ()
    method: ClassVar[str] = "compressed-tensors"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], path: Path) -> CompressedTensorsFp8Config:
        fields = ConfigFields(raw, path, "compressed-tensors")
        if raw.get("format") not in _FORMATS:
            fields.fail(
                f"format={raw.get('format')!r} is not supported: expected 'float-quantized' "
                "(FP8 weights)"
            )
        for key in ("sparsity_config", "transform_config"):
            if raw.get(key):
                fields.fail(f"{key} is set: sparse or transformed checkpoints are not supported")
        groups = fields.get("config_groups")
        if not isinstance(groups, dict) or len(groups) != 1:
            count = len(groups) if isinstance(groups, dict) else groups
            fields.fail(
                f"config_groups holds {count!r} groups: expected exactly one group (one scheme "
                "for every Linear layer)"
            )
        ((group_name, group),) = groups.items()
        if not isinstance(group, dict):
            fields.fail(f"config_groups.{group_name} is not an object")
        where = f"config_groups.{group_name}"
        if group.get("format") not in _FORMATS:
            fields.fail(f"{where}.format={group.get('format')!r} is not supported")
        targets = group.get("targets")
        if targets != ["Linear"]:
            fields.fail(f"{where}.targets={targets!r} is not supported: expected ['Linear']")
        block = cls._weights(fields, group.get("weights"), f"{where}.weights")
        dynamic = cls._activations(fields, group.get("input_activations"), where)
        if group.get("output_activations") is not None:
            fields.fail(f"{where}.output_activations is set: output quantization is not supported")
        kv_cache = raw.get("kv_cache_scheme")
        if kv_cache is not None and (
            not isinstance(kv_cache, dict)
            or kv_cache.get("type", "float") != "float"
            or kv_cache.get("num_bits") != 8
            or kv_cache.get("strategy", "tensor") != "tensor"
            or kv_cache.get("dynamic") is True
        ):
            fields.fail(
                f"kv_cache_scheme={kv_cache!r} is not supported: expected FP8 with one static "
                "scale per layer for K and V (strategy 'tensor'), or null"
            )
        return cls(block=block, dynamic_activations=dynamic, ignore=fields.names("ignore"))

    @staticmethod
    def _weights(fields: ConfigFields, weights: Any, where: str) -> tuple[int, int] | None:
        if not isinstance(weights, dict):
            fields.fail(f"{where} is {weights!r}: expected the weights' scheme")
        kind, bits = weights.get("type"), weights.get("num_bits")
        if kind != "float" or bits != 8:
            fields.fail(
                f"{where} has type={kind!r}, num_bits={bits!r}: only FP8 weights (type "
                "'float', num_bits 8) are supported"
            )
        if weights.get("symmetric") is False or weights.get("dynamic") is True:
            fields.fail(f"{where} must be symmetric and static (dynamic: false)")
        strategy = weights.get("strategy")
        if strategy == "channel":
            return None
        if strategy == "block":
            block = weights.get("block_structure")
            if (
                isinstance(block, list)
                and len(block) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block)
            ):
                return (block[0], block[1])
            fields.fail(f"{where}.block_structure={block!r} is invalid: expected [bn, bk]")
        fields.fail(
            f"{where}.strategy={strategy!r} is not supported: expected 'channel' or 'block' "
            "(per-tensor and per-group FP8 weight scales are not implemented)"
        )

    @staticmethod
    def _activations(fields: ConfigFields, activations: Any, where: str) -> bool:
        if activations is None:
            return False
        if not isinstance(activations, dict):
            fields.fail(f"{where}.input_activations is {activations!r}: expected an object")
        if activations.get("dynamic") is not True:
            fields.fail(
                f"{where}.input_activations.dynamic={activations.get('dynamic')!r} is not "
                "supported: expected true (static input scales are not implemented)"
            )
        if activations.get("type", "float") != "float" or activations.get("num_bits") != 8:
            fields.fail(f"{where}.input_activations must be FP8 (type 'float', num_bits 8)")
        return True

    def describe(self) -> str:
        scales = "per-channel" if self.block is None else f"{self.block[0]}x{self.block[1]}-block"
        return f"compressed-tensors (FP8 weights, {scales} scales)"

    def make_linear(self, names: Sequence[str], *, kernels: bool) -> LinearQuantMethod:
        return Fp8LinearMethod(
            names, kernels=kernels, block=self.block, scale_suffix="weight_scale"
        )
