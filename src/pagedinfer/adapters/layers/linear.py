"""Tensor-parallel linear layers and the weight loaders that cut a checkpoint into TP shards.

Every parameter carries two functions (see :func:`set_weight_loader`):

* ``checkpoint_shape(shard_id)``: the *full* shape the checkpoint tensor for that shard must
  have, as the model's config implies it. The model loader compares it with the tensor's
  shape before anything is read or narrowed, so a tensor that is too large cannot slip
  through a tensor-parallel slice.
* ``weight_loader(param, loaded_weight, shard_id=None)``: copies *this rank's* slice of the
  full tensor into the parameter, so the model loader never needs to know how a layer is split.

Layers:

* column parallel: the output features are split, each rank computes its own columns;
* row parallel: the input features are split, partial outputs are summed (all-reduce);
* packed layers hold several checkpoint tensors side by side (q/k/v, gate/up), addressed by
  a shard id, each one split across ranks on its own;
* replicated: every rank holds the whole tensor (a MoE router).

A layer is described by its output *segments* (one per packed checkpoint tensor: its full
size, this rank's size and where this rank's slice starts) and its input slice. Every tensor
it holds is described axis by axis (:class:`~pagedinfer.adapters.quantization.base.Axis`):
the dense ``weight [out, in]`` and ``bias [out]``, or, for a quantized layer, the tensors its
:class:`~pagedinfer.adapters.quantization.base.LinearQuantMethod` lists (FP8 weights and
their block or channel scales, packed int4 words, group scales and zero points). One loader
slices all of them: a scale of one element per 128 output features is cut where the weight
is, a word of eight packed values moves with its eight features. A split that would cut a
block, a group or a packed word is refused when the layer is built.

A quantized layer dequantizes once after loading, or keeps its quantized tensors for a GPU
kernel (:meth:`finish_loading`). A dense layer built with ``skinny_gemm=True`` (the Triton
path) runs the split-K Triton GEMM (:mod:`~pagedinfer.adapters.kernels.skinny_gemm`) for the
shapes where it beats cuBLAS (decode: few rows, few output tiles, on CUDA in 16 bits), and
``F.linear`` everywhere else, the CPU included. Parameters are created with the ``dtype`` and
``device`` each layer is given: nothing here reads or changes torch's process-wide defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.quantization.base import (
    FLOAT_CHECKPOINT_DTYPES,
    Axis,
    LinearGeometry,
    LinearQuantMethod,
    QuantizedMatmul,
    TensorSpec,
)
from pagedinfer.errors import ConfigurationError, UnsupportedModelError

__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "ShardId",
    "WeightLoader",
    "checkpoint_dtypes",
    "checkpoint_shape",
    "copy_checked",
    "default_weight_loader",
    "divide",
    "empty_parameter",
    "expected_shard_ids",
    "get_weight_loader",
    "is_optional",
    "set_weight_loader",
]

ShardId = str | int | tuple[int, int] | None
"""Which checkpoint tensor of a packed parameter: ``"q"``/``"k"``/``"v"``, a packed index
(``0`` gate, ``1`` up), an expert (``e``) or an expert's packed part (``(e, 0)``)."""

CheckpointShape = Callable[[ShardId], tuple[int, ...]]


class WeightLoader(Protocol):
    def __call__(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None: ...


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised, frozen parameter (the loader fills it)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
) -> None:
    """Copy a replicated (unsplit) tensor as is."""
    assert shard_id is None, f"an unpacked parameter got shard id {shard_id!r}"
    copy_checked(param.data, loaded_weight)


def set_weight_loader(
    param: nn.Parameter,
    loader: WeightLoader,
    shapes: CheckpointShape | None = None,
    shard_ids: Sequence[ShardId] = (None,),
) -> None:
    """Attach ``loader``, the full checkpoint ``shapes`` and the ``shard_ids`` that fill it."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    if shapes is not None:
        param.checkpoint_shape = shapes  # type: ignore[attr-defined]
    param.shard_ids = tuple(shard_ids)  # type: ignore[attr-defined]


def get_weight_loader(param: nn.Parameter) -> WeightLoader:
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


def checkpoint_shape(param: nn.Parameter, shard_id: ShardId) -> tuple[int, ...]:
    """The full shape of the checkpoint tensor that fills ``shard_id`` of ``param``.

    Parameters without a registered shape are replicated: the tensor has the parameter's shape.
    """
    shapes: CheckpointShape | None = getattr(param, "checkpoint_shape", None)
    return tuple(param.shape) if shapes is None else shapes(shard_id)


def expected_shard_ids(param: nn.Parameter) -> tuple[ShardId, ...]:
    """Every shard id a checkpoint must provide for ``param`` (``(None,)`` if unpacked)."""
    shard_ids: tuple[ShardId, ...] = getattr(param, "shard_ids", (None,))
    return shard_ids


def checkpoint_dtypes(param: nn.Parameter) -> tuple[frozenset[str], str]:
    """The safetensors dtypes a tensor for ``param`` may have (floats unless a quantized
    layer says otherwise) and what that tensor holds, in words, for messages."""
    dtypes: frozenset[str] = getattr(param, "checkpoint_dtypes", FLOAT_CHECKPOINT_DTYPES)
    layout: str = getattr(param, "checkpoint_layout", "")
    return dtypes, layout


def is_optional(param: nn.Parameter) -> bool:
    """True for a quantized layer's tensor that a checkpoint may leave out (GPTQ's g_idx)."""
    return bool(getattr(param, "optional", False))


def divide(total: int, world_size: int, what: str) -> int:
    """``total / world_size``, or a :class:`ConfigurationError` naming ``what`` if uneven."""
    if total % world_size:
        raise ConfigurationError(
            f"{what}={total} is not divisible by tensor_parallel_size={world_size}: "
            f"choose a tensor_parallel_size that divides {total}."
        )
    return total // world_size


def copy_checked(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` after checking the shapes agree (a shard never broadcasts)."""
    if target.shape != source.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(source.shape)} does not fit a parameter "
            f"(shard) of shape {tuple(target.shape)}"
        )
    target.copy_(source)


@dataclass(frozen=True, slots=True)
class _Slice:
    """``local`` features of a checkpoint tensor's ``full``, this rank's from ``start`` on."""

    full: int
    local: int
    start: int


# Whether the model layers that may run Triton kernels build their dense layers with
# skinny_gemm=True. Off until the GPU report's decode-GEMM table shows the kernel beating
# cuBLAS on the decode shapes (issue 28); the kernel's tests and that table run either way.
SKINNY_GEMM_IN_MODELS = False


@dataclass(frozen=True, slots=True)
class _SkinnyGemm:
    """The skinny GEMM's per-shape choice and the kernel (``adapters/kernels/skinny_gemm``)."""

    prefers: Callable[[torch.Tensor, torch.Tensor], bool]
    gemm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


_WEIGHT = TensorSpec(
    "weight", (Axis("output"), Axis("input")), None, FLOAT_CHECKPOINT_DTYPES, "the weight"
)
_BIAS = TensorSpec("bias", (Axis("output"),), None, FLOAT_CHECKPOINT_DTYPES, "the bias")


class _TensorLoader:
    """The weight loader of one tensor of a layer (see :meth:`LinearBase.load_tensor`)."""

    def __init__(self, layer: LinearBase, spec: TensorSpec) -> None:
        self.layer = layer
        self.spec = spec

    def __call__(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        self.layer.load_tensor(self.spec, param, loaded_weight, shard_id)

    def shape(self, shard_id: ShardId) -> tuple[int, ...]:
        return self.layer.checkpoint_shape_of(self.spec, shard_id)


class LinearBase(nn.Module):
    """``y = x W^T + b`` over this rank's slices (see the module docstring).

    ``outputs`` lists the packed checkpoint tensors in order (one, ``None``, when unpacked)
    with this rank's slice of each; ``inputs`` is this rank's slice of the input features.
    ``quant`` makes the layer hold that method's tensors instead of a dense ``weight``;
    ``skinny_gemm`` lets a dense weight run the split-K Triton GEMM where that kernel's
    per-shape choice says it wins (the Triton path; off, Triton is never imported).
    """

    weight: nn.Parameter  # dense layers, and quantized ones once dequantized
    # Fixed row tiles, whatever the number of rows (adapters/batch_invariant.py).
    batch_invariant = False

    def __init__(
        self,
        outputs: Sequence[tuple[ShardId, _Slice]],
        inputs: _Slice,
        *,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
        quant: LinearQuantMethod | None = None,
        skinny_gemm: bool = False,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.outputs = dict(outputs)
        self.inputs = inputs
        self.output_size = sum(part.local for part in self.outputs.values())
        self.input_size = inputs.local
        self.full_output = sum(part.full for part in self.outputs.values())
        self.full_input = inputs.full
        self.params_dtype = dtype
        self.quant = quant
        self.matmul: QuantizedMatmul | None = None  # a quantized GEMM, once loaded
        self._finished = quant is None
        self._skinny: _SkinnyGemm | None = None
        if skinny_gemm:  # Triton is imported only when the kernel may run
            from pagedinfer.adapters.kernels import skinny_gemm as kernel

            self._skinny = _SkinnyGemm(kernel.prefers_skinny_gemm, kernel.skinny_gemm)
        shard_ids = tuple(self.outputs)
        specs = quant.tensors() if quant is not None else (_WEIGHT,)
        for spec in specs:
            self._check_alignment(spec)
            param = empty_parameter(
                *self.local_shape_of(spec), dtype=spec.dtype or dtype, device=device
            )
            if spec.fill is not None:
                param.data.fill_(spec.fill)
            loader = _TensorLoader(self, spec)
            set_weight_loader(param, loader, loader.shape, shard_ids)
            param.checkpoint_dtypes = spec.checkpoint_dtypes  # type: ignore[attr-defined]
            param.checkpoint_layout = spec.layout  # type: ignore[attr-defined]
            param.optional = spec.optional  # type: ignore[attr-defined]
            self.register_parameter(spec.suffix, param)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = empty_parameter(*self.local_shape_of(_BIAS), dtype=dtype, device=device)
            loader = _TensorLoader(self, _BIAS)
            set_weight_loader(self.bias, loader, loader.shape, shard_ids)

    # ------------------------------------------------------------------ shapes and slices
    def local_shape_of(self, spec: TensorSpec) -> tuple[int, ...]:
        """The parameter's shape: this rank's slice of every packed shard, side by side."""
        shape = []
        for axis in spec.axes:
            if axis.along == "output":
                shape.append(sum(axis.elements(part.local) for part in self.outputs.values()))
            else:
                features = self.inputs.local if axis.split else self.inputs.full
                shape.append(axis.elements(features))
        return tuple(shape)

    def checkpoint_shape_of(self, spec: TensorSpec, shard_id: ShardId) -> tuple[int, ...]:
        """The full shape of the checkpoint tensor of ``spec`` for ``shard_id``."""
        part = self._output(shard_id)
        return tuple(
            axis.elements(part.full if axis.along == "output" else self.inputs.full)
            for axis in spec.axes
        )

    def _output(self, shard_id: ShardId) -> _Slice:
        part = self.outputs.get(shard_id)
        if part is None:
            raise AssertionError(
                f"{type(self).__name__} has shards {list(self.outputs)}, got {shard_id!r}"
            )
        return part

    def load_tensor(
        self, spec: TensorSpec, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId
    ) -> None:
        """Copy this rank's slice of checkpoint tensor ``loaded`` (shard ``shard_id``).

        Only a dimension that is really split is narrowed: an unsplit one is copied whole, so
        a tensor of the wrong size fails the shape check instead of being cut to fit.
        """
        part = self._output(shard_id)
        target, source = param.data, loaded
        for dim, axis in enumerate(spec.axes):
            step = axis.per_element
            if step is None:  # one element for the whole axis: nothing to cut
                continue
            if axis.along == "output":
                offset = 0
                for other_id, other in self.outputs.items():
                    if other_id == shard_id:
                        break
                    offset += axis.elements(other.local)
                size = axis.elements(part.local)
                target = target.narrow(dim, offset, size)
                if part.local != part.full:
                    source = source.narrow(dim, part.start // step, size)
            elif axis.split and self.inputs.local != self.inputs.full:
                size = axis.elements(self.inputs.local)
                source = source.narrow(dim, self.inputs.start // step, size)
        self._check_shared(spec, target, source, shard_id)
        copy_checked(target, source)

    def _check_shared(
        self, spec: TensorSpec, target: torch.Tensor, source: torch.Tensor, shard_id: ShardId
    ) -> None:
        """A tensor without an output axis in a packed layer is one tensor for every shard
        (GPTQ's g_idx: q, k and v read the same input, so GPTQ orders their columns alike):
        the second and later shards must hold what the first loaded."""
        shared = len(self.outputs) > 1 and all(axis.along == "input" for axis in spec.axes)
        if not shared or spec.fill is None or bool((target == spec.fill).all()):
            return  # not shared, or the first shard to arrive
        if target.shape == source.shape and torch.equal(target, source.to(target.dtype)):
            return
        assert self.quant is not None, "only quantized layers share a tensor"
        shards = list(self.outputs)
        raise UnsupportedModelError(
            f"{self.quant.names[shards.index(shard_id)]}.{spec.suffix} differs from "
            f"{self.quant.names[0]}.{spec.suffix}: pagedinfer packs these modules into one "
            f"layer, which needs one {spec.suffix} for all of them."
        )

    def _check_alignment(self, spec: TensorSpec) -> None:
        """Refuse a layout this layer's sizes or its tensor-parallel split cannot hold."""
        if self.quant is None:
            return
        name = self.quant.name
        world = self.parallel.world_size
        parts = list(self.outputs.values())
        for axis in spec.axes:
            step = axis.per_element
            assert step is not None or axis.along == "input", "output axes are never whole"
            if step is None or step == 1:
                continue
            if axis.along == "output":
                slices = [(part, index < len(parts) - 1) for index, part in enumerate(parts)]
            else:
                slices = [(self.inputs, False)]
            for part, packed_before_another in slices:
                if part.full % step and not axis.partial:
                    raise UnsupportedModelError(
                        f"{name}: {part.full} {axis.along} features cannot hold {spec.layout} "
                        f"({step} features per element): the checkpoint's quantization does "
                        "not fit this model's sizes."
                    )
                cut = part.local != part.full and axis.split and part.local % step
                if cut or (packed_before_another and part.local % step):
                    reason = (
                        f"tensor_parallel_size={world} gives each rank {part.local} of its "
                        f"{part.full} {axis.along} features"
                        if cut
                        else f"its packed shards hold {part.local} {axis.along} features each"
                    )
                    raise ConfigurationError(
                        f"{name}: {reason}, which is not a multiple of the {step} features "
                        f"that share one element of {spec.layout}: the split would cut it. "
                        "Choose a tensor_parallel_size that keeps every rank's slice a "
                        f"multiple of {step}."
                    )

    # ------------------------------------------------------------------ after loading
    def finish_loading(self) -> None:
        """Called once every tensor is loaded: a quantized layer dequantizes its tensors
        into ``weight`` or prepares its GPU kernel (its method decides); dense layers have
        nothing to do."""
        quant = self.quant
        if quant is None or self._finished:
            return
        tensors: dict[str, torch.Tensor] = {}
        for spec in quant.tensors():
            tensors[spec.suffix] = self.get_parameter(spec.suffix).data
            delattr(self, spec.suffix)
        device = next(iter(tensors.values())).device
        geometry = LinearGeometry(
            name=quant.name,
            output_features=self.output_size,
            input_features=self.input_size,
            input_start=self.inputs.start,
            dtype=self.params_dtype,
            device=device,
        )
        result = quant.finish(tensors, geometry)
        if isinstance(result, torch.Tensor):
            assert result.shape == (self.output_size, self.input_size), result.shape
            self.weight = nn.Parameter(result, requires_grad=False)
        else:
            self.matmul = result
        self._finished = True

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias`` with this rank's weight (dense, or the quantized GEMM); a dense
        weight runs the skinny split-K GEMM where its per-shape choice says so."""
        if self.batch_invariant:
            return self._invariant_linear(x, bias)
        if self.matmul is not None:
            out: torch.Tensor = self.matmul(x)
            return out if bias is None else out + bias
        assert self._finished, f"{self.quant and self.quant.name}: used before finish_loading()"
        skinny = self._skinny
        if skinny is not None and skinny.prefers(x, self.weight):
            return skinny.gemm(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def _invariant_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """:meth:`linear` in fixed row tiles (no skinny GEMM): batch-invariant rows."""
        from pagedinfer.adapters.batch_invariant import in_row_tiles, tiled_linear

        matmul = self.matmul
        if matmul is None:
            return tiled_linear(x, self.weight, bias)
        out = in_row_tiles(x.reshape(-1, x.shape[-1]), matmul).view(*x.shape[:-1], -1)
        return out if bias is None else out + bias


def _column_slices(
    shards: Sequence[tuple[ShardId, int]], parallel: ParallelContext, what: str
) -> list[tuple[ShardId, _Slice]]:
    slices = []
    for shard_id, full in shards:
        local = divide(full, parallel.world_size, what)
        slices.append((shard_id, _Slice(full, local, parallel.rank * local)))
    return slices


class ReplicatedLinear(LinearBase):
    """``y = x W^T + b`` with the whole weight on every rank (small layers: a MoE router)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
        bias: bool = False,
        quant: LinearQuantMethod | None = None,
        skinny_gemm: bool = False,
    ) -> None:
        super().__init__(
            [(None, _Slice(output_size, output_size, 0))],
            _Slice(input_size, input_size, 0),
            bias=bias,
            parallel=parallel,
            dtype=dtype,
            device=device,
            quant=quant,
            skinny_gemm=skinny_gemm,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's output rows split across ranks; output stays split.

    ``packed`` lists several checkpoint tensors stored side by side, as ``(shard id, output
    features)``; each is split across ranks on its own (see the subclasses).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
        bias: bool = False,
        what: str = "output features",
        quant: LinearQuantMethod | None = None,
        packed: Sequence[tuple[ShardId, int]] = (),
        skinny_gemm: bool = False,
    ) -> None:
        shards = list(packed) or [(None, output_size)]
        assert sum(size for _, size in shards) == output_size, (shards, output_size)
        super().__init__(
            _column_slices(shards, parallel, what),
            _Slice(input_size, input_size, 0),
            bias=bias,
            parallel=parallel,
            dtype=dtype,
            device=device,
            quant=quant,
            skinny_gemm=skinny_gemm,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input packed side by side.

    Shard ``i`` is the checkpoint tensor of ``output_sizes[i]`` rows; each rank holds
    ``output_sizes[i] / world_size`` rows of every shard, in shard order (gate/up in the MLP).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
        bias: bool = False,
        what: str = "intermediate_size",
        quant: LinearQuantMethod | None = None,
        skinny_gemm: bool = False,
    ) -> None:
        self.output_sizes = tuple(output_sizes)
        super().__init__(
            input_size,
            sum(self.output_sizes),
            parallel=parallel,
            dtype=dtype,
            device=device,
            bias=bias,
            what=what,
            quant=quant,
            skinny_gemm=skinny_gemm,
            packed=list(enumerate(self.output_sizes)),
        )


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections packed as ``[q heads | k heads | v heads]`` of this rank."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
        bias: bool = False,
        quant: LinearQuantMethod | None = None,
        skinny_gemm: bool = False,
    ) -> None:
        world = parallel.world_size
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = divide(num_heads, world, "num_attention_heads")
        self.num_kv_heads = divide(num_kv_heads, world, "num_key_value_heads")
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            q_rows + 2 * kv_rows,
            parallel=parallel,
            dtype=dtype,
            device=device,
            bias=bias,
            quant=quant,
            skinny_gemm=skinny_gemm,
            packed=[("q", q_rows), ("k", kv_rows), ("v", kv_rows)],
        )


class RowParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's input columns split: each rank sums a partial product.

    The bias is not split; rank 0 adds it once.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
        bias: bool = False,
        what: str = "input features",
        quant: LinearQuantMethod | None = None,
        skinny_gemm: bool = False,
    ) -> None:
        per_rank = divide(input_size, parallel.world_size, what)
        super().__init__(
            [(None, _Slice(output_size, output_size, 0))],
            _Slice(input_size, per_rank, parallel.rank * per_rank),
            bias=bias,
            parallel=parallel,
            dtype=dtype,
            device=device,
            quant=quant,
            skinny_gemm=skinny_gemm,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.parallel.rank == 0 else None
        return self.parallel.all_reduce(self.linear(x, bias))
