"""``quant_method: "awq"``: AutoAWQ's 4-bit GEMM checkpoints.

``config.json``::

    "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                            "zero_point": true, "version": "gemm",
                            "modules_to_not_convert": null}

(AutoAWQ's own spelling, ``w_bit`` / ``q_group_size``, is read too.) Each quantized module
stores, for ``K`` input and ``N`` output features and groups of ``G`` input features:

* ``qweight`` int32 ``[K, N / 8]``: eight 4-bit values per word along the output features,
  in AWQ's order (output features ``0, 2, 4, 6, 1, 3, 5, 7`` in bits ``0, 4, ..., 28``);
* ``qzeros`` int32 ``[K / G, N / 8]``: the zero points, packed the same way;
* ``scales`` float16 ``[K / G, N]``.

``W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]``. Tensor parallelism cuts ``qweight``
and ``scales`` along the output features in whole words (column parallel: each rank's
features a multiple of 8) and along the input features in whole groups (row parallel: a
multiple of ``G``); a split that does not is refused.

Refused, naming the field: ``bits`` other than 4, ``zero_point: false``, and versions other
than ``gemm`` (``gemv``, ``gemv_fast``, ``marlin``, ``exllama`` pack differently).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from pagedinfer.adapters.quantization.base import (
    Axis,
    ConfigFields,
    LinearGeometry,
    LinearQuantMethod,
    QuantizationConfig,
    TensorSpec,
)
from pagedinfer.adapters.quantization.fp8 import SCALE_CHECKPOINT_DTYPES
from pagedinfer.adapters.quantization.int4 import (
    AWQ_POSITIONS,
    INT4_CHECKPOINT_DTYPES,
    Int4LinearMethod,
    Int4Weights,
    unpack_int4,
)

__all__ = ["AwqConfig", "AwqLinearMethod"]


def group_size_field(fields: ConfigFields, *keys: str) -> int | None:
    """A positive group size, or None for ``-1`` (one group for every input feature)."""
    size = fields.integer(*keys)
    if size == -1:
        return None
    if size <= 0:
        fields.fail(f"{keys[0]}={size} is invalid: expected a positive group size or -1")
    return size


@dataclass(frozen=True, slots=True)
class AwqConfig(QuantizationConfig):
    group_size: int | None
    ignore: tuple[str, ...] = ()
    method: ClassVar[str] = "awq"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], path: Path) -> AwqConfig:
        fields = ConfigFields(raw, path, "awq")
        bits = fields.integer("bits", "w_bit")
        if bits != 4:
            fields.fail(f"bits={bits} is not supported: expected 4")
        if not fields.flag("zero_point", default=True):
            fields.fail("zero_point=false is not supported: expected AWQ with zero points")
        version = str(fields.get("version", default="gemm")).lower()
        if version != "gemm":
            fields.fail(
                f"version={version!r} is not supported: expected 'gemm' (the other AWQ "
                "layouts pack their tensors differently)"
            )
        return cls(
            group_size=group_size_field(fields, "group_size", "q_group_size"),
            ignore=fields.names("modules_to_not_convert"),
        )

    def describe(self) -> str:
        groups = "one group" if self.group_size is None else f"group size {self.group_size}"
        return f"awq (4-bit, {groups}, zero points)"

    def make_linear(self, names: Sequence[str], *, kernels: bool) -> LinearQuantMethod:
        return AwqLinearMethod(names, kernels=kernels, group_size=self.group_size)


class AwqLinearMethod(Int4LinearMethod):
    def tensors(self) -> tuple[TensorSpec, ...]:
        size = self.group_size
        groups = "all input features" if size is None else f"{size} input features"
        return (
            TensorSpec(
                "qweight",
                (Axis("input"), Axis("output", per_element=8)),
                torch.int32,
                INT4_CHECKPOINT_DTYPES,
                "AWQ's packed 4-bit weight (8 output features per int32)",
            ),
            TensorSpec(
                "qzeros",
                (Axis("input", per_element=size), Axis("output", per_element=8)),
                torch.int32,
                INT4_CHECKPOINT_DTYPES,
                f"AWQ's packed zero points (one row per group of {groups})",
            ),
            TensorSpec(
                "scales",
                (Axis("input", per_element=size), Axis("output")),
                torch.float32,
                SCALE_CHECKPOINT_DTYPES,
                f"AWQ's scales (one row per group of {groups})",
            ),
        )

    def unpack(self, tensors: Mapping[str, torch.Tensor], geometry: LinearGeometry) -> Int4Weights:
        return Int4Weights(
            q=unpack_int4(tensors["qweight"], 1, AWQ_POSITIONS),
            zeros=unpack_int4(tensors["qzeros"], 1, AWQ_POSITIONS),
            scales=tensors["scales"],
            g_idx=self.local_groups(geometry, scales_split=True),
        )
