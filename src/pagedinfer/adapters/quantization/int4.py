"""4-bit integer weights with per-group scales and zero points: what AWQ and GPTQ share.

Both store, for a weight ``W [N, K]`` (``N`` output, ``K`` input features) in groups of
``G`` input features, integers ``q`` in ``0..15`` packed eight to an int32, a zero point
``z`` and a scale ``s`` per (group, output feature), and read the weight back as
``W[n, k] = (q[k, n] - z[g(k), n]) * s[g(k), n]``. They differ in how they pack (see
``awq.py`` and ``gptq.py``) and in ``g(k)``: ``k // G`` for AWQ, GPTQ's ``g_idx[k]`` (any
order with ``desc_act``).

Each format's method unpacks its tensors into :class:`Int4Weights` (this rank's slice, in
one layout), then :meth:`Int4LinearMethod.finish` either dequantizes once (the CPU path) or
prepares :class:`Int4Matmul` for the Triton GEMM (``adapters/kernels/int4_gemm.py``): the
integers repacked eight per int32 along ``K`` (``[K / 8, N]``), zero points as uint8 and
scales as float32 ``[groups, N]`` and the group of every input feature (int32 ``[K]``), so
AWQ and GPTQ share one kernel. Scales are kept in float32 so that float16 checkpoint scales
stay exact in a bfloat16 model; the cost is 5 bytes per group and output feature (~8 % of
the 4-bit weight's bytes at group size 128).
"""

from __future__ import annotations

import importlib
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pagedinfer.adapters.quantization.base import (
    LinearGeometry,
    LinearQuantMethod,
    QuantizedMatmul,
)
from pagedinfer.errors import UnsupportedModelError

__all__ = [
    "AWQ_POSITIONS",
    "INT4_CHECKPOINT_DTYPES",
    "SEQUENTIAL_POSITIONS",
    "Int4LinearMethod",
    "Int4Matmul",
    "Int4Weights",
    "dequantize_int4",
    "int4_kernel_available",
    "pack_int4",
    "unpack_int4",
]

INT4_CHECKPOINT_DTYPES: frozenset[str] = frozenset({"I32"})

SEQUENTIAL_POSITIONS = (0, 1, 2, 3, 4, 5, 6, 7)
"""Element ``j`` of eight packed values sits in bits ``4 * j`` (GPTQ)."""
AWQ_POSITIONS = (0, 4, 1, 5, 2, 6, 3, 7)
"""AWQ stores elements ``0, 2, 4, 6, 1, 3, 5, 7`` in bits ``0, 4, 8, ...``: element ``j`` sits
in nibble ``AWQ_POSITIONS[j]`` (AutoAWQ's ``order_map``, inverted)."""


def unpack_int4(packed: torch.Tensor, dim: int, positions: Sequence[int]) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (int32, ``0..15``) along ``dim``: element
    ``8 * i + j`` comes from word ``i``, nibble ``positions[j]``."""
    shifts = torch.tensor([4 * p for p in positions], dtype=torch.int32, device=packed.device)
    shape = [1] * (packed.dim() + 1)
    shape[dim + 1] = 8
    values = (packed.unsqueeze(dim + 1) >> shifts.view(shape)) & 0xF
    return values.flatten(dim, dim + 1)


def pack_int4(values: torch.Tensor, dim: int, positions: Sequence[int]) -> torch.Tensor:
    """The inverse of :func:`unpack_int4`: values ``0..15`` -> int32 words along ``dim``."""
    size = values.shape[dim]
    assert size % 8 == 0, f"{size} values do not fill whole int32 words"
    shape = [*values.shape[:dim], size // 8, 8, *values.shape[dim + 1 :]]
    grouped = values.to(torch.int64).reshape(shape)
    shifts = torch.tensor([4 * p for p in positions], dtype=torch.int64, device=values.device)
    view = [1] * len(shape)
    view[dim + 1] = 8
    words = (grouped << shifts.view(view)).sum(dim + 1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement int32
    return words.to(torch.int32)


@dataclass(frozen=True, slots=True)
class Int4Weights:
    """This rank's 4-bit weight in one layout: ``q [K, N]`` (0..15), ``zeros`` and ``scales``
    ``[groups, N]``, ``g_idx [K]`` (each input feature's row of ``zeros`` / ``scales``)."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor


def dequantize_int4(weights: Int4Weights) -> torch.Tensor:
    """``W [N, K]`` in float32: ``(q - z[g]) * s[g]``, transposed to a linear weight."""
    g = weights.g_idx.long()
    zeros = weights.zeros.float()[g]
    scales = weights.scales.float()[g]
    return ((weights.q.float() - zeros) * scales).t().contiguous()


def int4_kernel_available(device: torch.device) -> bool:
    """Whether :func:`~pagedinfer.adapters.kernels.int4_gemm.int4_gemm` runs on ``device``
    (any CUDA GPU; on the CPU only Triton's interpreter, for tests)."""
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        kernels = importlib.import_module("pagedinfer.adapters.kernels")
        return bool(kernels.interpreter_enabled())
    return False


class Int4Matmul(QuantizedMatmul):
    """``x W^T`` from the 4-bit weight in the kernel's layout (see the module docstring)."""

    def __init__(self, weights: Int4Weights) -> None:
        super().__init__()

        def frozen(tensor: torch.Tensor) -> torch.nn.Parameter:
            return torch.nn.Parameter(tensor.contiguous(), requires_grad=False)

        self.qweight = frozen(pack_int4(weights.q, 0, SEQUENTIAL_POSITIONS))  # [K / 8, N]
        self.zeros = frozen(weights.zeros.to(torch.uint8))
        self.scales = frozen(weights.scales.float())
        self.g_idx = frozen(weights.g_idx.to(torch.int32))
        self._gemm = importlib.import_module("pagedinfer.adapters.kernels.int4_gemm").int4_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._gemm(x, self.qweight, self.zeros, self.scales, self.g_idx)
        return out


class Int4LinearMethod(LinearQuantMethod):
    """A 4-bit format: the subclass lists its tensors and unpacks them (:meth:`unpack`)."""

    def __init__(self, names: Sequence[str], *, kernels: bool, group_size: int | None) -> None:
        super().__init__(names, kernels=kernels)
        self.group_size = group_size  # None: one group for all input features

    @abstractmethod
    def unpack(self, tensors: Mapping[str, torch.Tensor], geometry: LinearGeometry) -> Int4Weights:
        """This rank's tensors (by suffix) in the common layout."""

    def finish(
        self, tensors: Mapping[str, torch.Tensor], geometry: LinearGeometry
    ) -> torch.Tensor | QuantizedMatmul:
        weights = self.unpack(tensors, geometry)
        groups = weights.scales.shape[0]
        g_idx = weights.g_idx
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise UnsupportedModelError(
                f"{self.name}.g_idx holds group indices from {int(g_idx.min())} to "
                f"{int(g_idx.max())}, but the layer has {groups} groups of scales and zero "
                "points: expected indices in [0, groups) (the checkpoint is inconsistent)."
            )
        if self.kernels and int4_kernel_available(geometry.device):
            return Int4Matmul(weights)
        return dequantize_int4(weights).to(geometry.dtype)

    def local_groups(self, geometry: LinearGeometry, scales_split: bool) -> torch.Tensor:
        """``k // group_size`` for this rank's input features, as rows of its scales
        (rebased to this rank's first group when the scales are split across ranks)."""
        size = self.group_size
        k = torch.arange(geometry.input_features, device=geometry.device)
        if size is None:
            return torch.zeros_like(k)
        if scales_split:
            return k // size
        return (k + geometry.input_start) // size
