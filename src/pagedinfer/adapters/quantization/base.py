"""What every quantization method provides, and how a linear layer stores its tensors.

A method is two objects:

* a :class:`QuantizationConfig`, parsed from ``config.json``'s ``quantization_config``; it
  decides, per linear layer, whether the layer is quantized (``ignore`` lists) and hands out
  a :class:`LinearQuantMethod`;
* a :class:`LinearQuantMethod`, one per layer: which checkpoint tensors the layer holds
  (:class:`TensorSpec`), and, once they are loaded, what the layer computes with them
  (:meth:`LinearQuantMethod.finish`): either a dense weight (dequantized once, the CPU path) or
  a module running a quantized GEMM kernel (:class:`QuantizedMatmul`).

A tensor's layout is described axis by axis (:class:`Axis`): which feature axis of the layer
the tensor's dimension runs along (output or input features) and how many features one
element covers (a pack factor, a group or a block). From that, the linear layer
(``adapters/layers/linear.py``) derives the full checkpoint shape, this rank's tensor-parallel
slice, where each packed shard (q/k/v, gate/up) goes, and whether a split would cut a block,
a group or a packed word (refused).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, NoReturn

import torch
from torch import nn

from pagedinfer.errors import UnsupportedModelError

__all__ = [
    "FLOAT_CHECKPOINT_DTYPES",
    "Axis",
    "ConfigFields",
    "LinearGeometry",
    "LinearQuantMethod",
    "QuantizationConfig",
    "QuantizedMatmul",
    "TensorSpec",
    "matches_module",
]

FLOAT_CHECKPOINT_DTYPES: frozenset[str] = frozenset({"F16", "BF16", "F32", "F64"})
"""safetensors dtype names of a float tensor (a dense weight, a bias, a scale)."""


@dataclass(frozen=True, slots=True)
class Axis:
    """One dimension of a checkpoint tensor, in terms of the layer's feature axes.

    ``per_element`` features of ``along`` share one element: 1 for a plain weight, 8 for
    eight 4-bit values packed in an int32, a group size for per-group scales, a block size
    for block scales; ``None``: one element for the whole axis (per-channel scales
    ``[N, 1]``, GPTQ's ``group_size: -1``). ``partial``: a last, partial block is stored
    (block scales: ``ceil(features / block)`` elements); otherwise the features must divide.
    ``split``: the dimension follows the layer's tensor-parallel split of that axis (False:
    every rank holds all of it, e.g. GPTQ act-order scales in a row-parallel layer).
    """

    along: Literal["output", "input"]
    per_element: int | None = 1
    partial: bool = False
    split: bool = True

    def elements(self, features: int) -> int:
        """How many elements cover ``features`` features (the caller checked divisibility)."""
        if self.per_element is None:
            return 1
        return -(-features // self.per_element)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One checkpoint tensor of a quantized linear module, ``<module>.<suffix>``.

    ``dtype`` is the parameter's dtype (``None``: the model's dtype); ``checkpoint_dtypes``
    the safetensors dtypes accepted (converted on load). ``layout`` says in words what the
    tensor holds, for error messages. An ``optional`` tensor may be absent from the
    checkpoint (its parameter then keeps the ``fill`` value it was created with).
    """

    suffix: str
    axes: tuple[Axis, ...]
    dtype: torch.dtype | None
    checkpoint_dtypes: frozenset[str]
    layout: str
    optional: bool = False
    fill: float | int | None = None


@dataclass(frozen=True, slots=True)
class LinearGeometry:
    """What a method needs to know of its layer when it finishes loading.

    ``output_features`` / ``input_features`` are this rank's; ``input_start`` is the first
    input feature this rank holds (row parallel: ``rank * input_features``, else 0).
    """

    name: str
    output_features: int
    input_features: int
    input_start: int
    dtype: torch.dtype
    device: torch.device


class QuantizedMatmul(nn.Module):
    """``x [T, in] -> x W^T [T, out]`` from quantized tensors, on a GPU kernel (no bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class LinearQuantMethod(ABC):
    """How one linear layer (one packed group of checkpoint modules) is quantized.

    ``names`` are the checkpoint modules the layer is built from (several for a packed
    layer), used in messages. ``kernels`` asks for the quantized GEMM (the Triton and flash
    paths); without it, or where the device cannot run the kernel, :meth:`finish`
    dequantizes once.
    """

    def __init__(self, names: Sequence[str], *, kernels: bool) -> None:
        self.names = tuple(names)
        self.kernels = kernels

    @property
    def name(self) -> str:
        return " / ".join(self.names)

    @abstractmethod
    def tensors(self) -> tuple[TensorSpec, ...]:
        """Every checkpoint tensor of each module, besides an optional float ``bias``."""

    @abstractmethod
    def finish(
        self, tensors: Mapping[str, torch.Tensor], geometry: LinearGeometry
    ) -> torch.Tensor | QuantizedMatmul:
        """From the loaded tensors (by suffix): the dense weight ``[out, in]`` in
        ``geometry.dtype`` (dequantized), or a :class:`QuantizedMatmul`."""


class QuantizationConfig(ABC):
    """A checkpoint's ``quantization_config``, parsed and validated."""

    method: ClassVar[str]  # quant_method as config.json spells it
    ignore: tuple[str, ...]  # modules left unquantized: names, or "re:<regex>"
    # The only architectures the method has a path for (None: any decoder).
    architectures: ClassVar[frozenset[str] | None] = None

    @abstractmethod
    def describe(self) -> str:
        """One line for logs and messages, e.g. ``fp8 (e4m3, 128x128 blocks)``."""

    @abstractmethod
    def make_linear(self, names: Sequence[str], *, kernels: bool) -> LinearQuantMethod:
        """The method of a quantized linear layer built from checkpoint modules ``names``."""

    def linear_method(self, names: Sequence[str], *, kernels: bool) -> LinearQuantMethod | None:
        """The method of the linear layer made of checkpoint modules ``names`` (e.g.
        ``model.layers.0.self_attn.q_proj``, ``k_proj``, ``v_proj`` for a packed layer), or
        ``None`` if the ``ignore`` list leaves it unquantized.

        The modules of a packed layer are quantized all or none: a list that ignores some of
        them is refused (:class:`~pagedinfer.errors.UnsupportedModelError`).
        """
        ignored = [matches_module(name, self.ignore) for name in names]
        if all(ignored):
            return None
        if any(ignored):
            kept = [name for name, skip in zip(names, ignored, strict=True) if not skip]
            skipped = [name for name, skip in zip(names, ignored, strict=True) if skip]
            raise UnsupportedModelError(
                f"quantization_config ({self.method}) leaves {skipped} unquantized but not "
                f"{kept}, which pagedinfer packs into one layer: expected all of them or none "
                "in the ignore list."
            )
        return self.make_linear(names, kernels=kernels)


def matches_module(name: str, patterns: Sequence[str]) -> bool:
    """True if checkpoint module ``name`` is in ``patterns``.

    A pattern is a module name (``lm_head``, ``model.layers.3.mlp.down_proj``), matched as a
    whole name or as a dotted suffix or prefix of it (``mlp.down_proj``, ``model.layers.3``),
    or ``re:<regex>`` matched against the whole name (compressed-tensors' convention).
    """
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], name):
                return True
        elif f".{pattern}." in f".{name}.":
            return True
    return False


_MISSING: Any = object()


class ConfigFields:
    """Typed access to ``quantization_config`` with errors naming the checkpoint, the
    method and the field (an :class:`~pagedinfer.errors.UnsupportedModelError`)."""

    def __init__(self, raw: Mapping[str, Any], path: Path, method: str) -> None:
        self.raw = raw
        self.path = path
        self.method = method

    def fail(self, problem: str) -> NoReturn:
        raise UnsupportedModelError(
            f"checkpoint {str(self.path)!r}: quantization_config (quant_method "
            f"{self.method!r}): {problem}."
        )

    def get(self, *keys: str, default: Any = _MISSING) -> Any:
        """The value of the first of ``keys`` present (tools spell some fields two ways)."""
        for key in keys:
            if key in self.raw:
                return self.raw[key]
        if default is _MISSING:
            self.fail(f"has no {' or '.join(repr(key) for key in keys)}")
        return default

    def integer(self, *keys: str, default: Any = _MISSING) -> int:
        value = self.get(*keys, default=default)
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(f"{keys[0]}={value!r} is invalid: expected an integer")
        return value

    def flag(self, *keys: str, default: Any = _MISSING) -> bool:
        value = self.get(*keys, default=default)
        if not isinstance(value, bool):
            self.fail(f"{keys[0]}={value!r} is invalid: expected true or false")
        return value

    def names(self, *keys: str) -> tuple[str, ...]:
        """Every listed module name of ``keys`` (each a list of strings, or null)."""
        found: list[str] = []
        for key in keys:
            value = self.raw.get(key)
            if value is None:
                continue
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                self.fail(f"{key}={value!r} is invalid: expected a list of module names")
            found.extend(value)
        return tuple(found)
