"""``quant_method: "gptq"``: AutoGPTQ / GPTQModel / optimum 4-bit checkpoints.

``config.json``::

    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                            "desc_act": false, "sym": true, "checkpoint_format": "gptq"}

Each quantized module stores, for ``K`` input and ``N`` output features and groups of ``G``
input features (``group_size: -1``: one group):

* ``qweight`` int32 ``[K / 8, N]``: eight 4-bit values per word along the *input* features,
  in order (input feature ``8 i + j`` in bits ``4 j`` of row ``i``);
* ``qzeros`` int32 ``[groups, N / 8]``: zero points packed along the output features, in
  order; the ``gptq`` (v1) format stores each zero point minus one (``gptq_v2`` does not);
* ``scales`` float16 ``[groups, N]``;
* ``g_idx`` int32 ``[K]``: the group of every input feature. Without ``desc_act`` it is
  ``k // G``; with it (act-order) the groups follow the order GPTQ quantized the columns in,
  so ``g_idx`` is any assignment. A checkpoint without ``g_idx`` gets ``k // G``.

``W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``, symmetric (``sym: true``, every
zero point 8) or not. Tensor parallelism cuts ``qweight`` in whole words and ``qzeros`` /
``scales`` in whole groups; with ``desc_act`` a row-parallel layer's ranks each keep every
group's scales and zero points (a rank's input features may use any group), as vLLM does.
A split that cuts a word or (without ``desc_act``) a group is refused.

Refused, naming the field: ``bits`` other than 4, a quantized ``lm_head``, per-module
``dynamic`` overrides, packing other than int32 and checkpoint formats other than ``gptq`` /
``gptq_v2`` (e.g. ``marlin``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from pagedinfer.adapters.quantization.awq import group_size_field
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
    INT4_CHECKPOINT_DTYPES,
    SEQUENTIAL_POSITIONS,
    Int4LinearMethod,
    Int4Weights,
    unpack_int4,
)

__all__ = ["GptqConfig", "GptqLinearMethod"]

_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True, slots=True)
class GptqConfig(QuantizationConfig):
    group_size: int | None
    desc_act: bool
    sym: bool
    zeros_minus_one: bool  # the v1 ("gptq") format's stored zero points are z - 1
    ignore: tuple[str, ...] = ()
    method: ClassVar[str] = "gptq"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], path: Path) -> GptqConfig:
        fields = ConfigFields(raw, path, "gptq")
        bits = fields.integer("bits")
        if bits != 4:
            fields.fail(f"bits={bits} is not supported: expected 4")
        fmt = fields.get("checkpoint_format", "format", default="gptq")
        if fmt not in _FORMATS:
            fields.fail(f"checkpoint_format={fmt!r} is not supported: expected 'gptq'")
        if fields.get("lm_head", default=False):
            fields.fail("lm_head=true is not supported: expected an unquantized LM head")
        if fields.get("dynamic", default=None):
            fields.fail("per-module 'dynamic' overrides are not supported")
        pack = fields.get("pack_dtype", default="int32")
        if pack not in ("int32", "torch.int32"):
            fields.fail(f"pack_dtype={pack!r} is not supported: expected int32")
        return cls(
            group_size=group_size_field(fields, "group_size"),
            desc_act=fields.flag("desc_act", default=False),
            sym=fields.flag("sym", default=True),
            zeros_minus_one=fmt == "gptq",
            ignore=fields.names("modules_to_not_convert"),
        )

    def describe(self) -> str:
        groups = "one group" if self.group_size is None else f"group size {self.group_size}"
        order = ", act-order" if self.desc_act else ""
        kind = "symmetric" if self.sym else "asymmetric"
        return f"gptq (4-bit, {groups}{order}, {kind})"

    def make_linear(self, names: Sequence[str], *, kernels: bool) -> LinearQuantMethod:
        return GptqLinearMethod(names, kernels=kernels, config=self)


class GptqLinearMethod(Int4LinearMethod):
    def __init__(self, names: Sequence[str], *, kernels: bool, config: GptqConfig) -> None:
        super().__init__(names, kernels=kernels, group_size=config.group_size)
        self.config = config
        # Act-order: a rank's input features may belong to any group, so every rank keeps
        # every group's scales and zero points (one group for all: nothing to split either).
        self.scales_split = not config.desc_act and config.group_size is not None

    def tensors(self) -> tuple[TensorSpec, ...]:
        size = self.group_size
        groups = "all input features" if size is None else f"{size} input features"
        # AutoGPTQ stores ceil(K / G) groups: a last, partial group is allowed.
        group_axis = Axis("input", per_element=size, partial=True, split=self.scales_split)
        return (
            TensorSpec(
                "qweight",
                (Axis("input", per_element=8), Axis("output")),
                torch.int32,
                INT4_CHECKPOINT_DTYPES,
                "GPTQ's packed 4-bit weight (8 input features per int32)",
            ),
            TensorSpec(
                "qzeros",
                (group_axis, Axis("output", per_element=8)),
                torch.int32,
                INT4_CHECKPOINT_DTYPES,
                f"GPTQ's packed zero points (one row per group of {groups})",
            ),
            TensorSpec(
                "scales",
                (group_axis, Axis("output")),
                torch.float32,
                SCALE_CHECKPOINT_DTYPES,
                f"GPTQ's scales (one row per group of {groups})",
            ),
            TensorSpec(
                "g_idx",
                (Axis("input"),),
                torch.int32,
                frozenset({"I32", "I64"}),
                "GPTQ's group index of every input feature",
                optional=True,
                fill=-1,
            ),
        )

    def unpack(self, tensors: Mapping[str, torch.Tensor], geometry: LinearGeometry) -> Int4Weights:
        zeros = unpack_int4(tensors["qzeros"], 1, SEQUENTIAL_POSITIONS)
        if self.config.zeros_minus_one:
            zeros = zeros + 1
        g_idx = tensors["g_idx"].long()
        if bool((g_idx == -1).all()):  # not in the checkpoint: the plain k // G
            g_idx = self.local_groups(geometry, scales_split=self.scales_split)
        elif self.scales_split:  # this rank's scales start at its first group
            assert self.group_size is not None
            g_idx = g_idx - geometry.input_start // self.group_size
        return Int4Weights(
            q=unpack_int4(tensors["qweight"], 0, SEQUENTIAL_POSITIONS),
            zeros=zeros,
            scales=tensors["scales"],
            g_idx=g_idx,
        )
