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

Parameters are created with the ``dtype`` and ``device`` each layer is given: nothing here
reads or changes torch's process-wide defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.errors import ConfigurationError

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "ShardId",
    "WeightLoader",
    "checkpoint_shape",
    "copy_checked",
    "default_weight_loader",
    "divide",
    "empty_parameter",
    "expected_shard_ids",
    "get_weight_loader",
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


class _LinearBase(nn.Module):
    """``weight [output_per_rank, input_per_rank]`` plus an optional bias.

    ``full_input`` / ``full_output`` are the checkpoint's (unsplit) sizes.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
        full_input: int,
        full_output: int,
        shard_ids: Sequence[ShardId] = (None,),
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_size = input_size
        self.output_size = output_size
        self.full_input = full_input
        self.full_output = full_output
        self.weight = empty_parameter(output_size, input_size, dtype=dtype, device=device)
        set_weight_loader(self.weight, self.weight_loader, self._weight_shape, shard_ids)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = empty_parameter(output_size, dtype=dtype, device=device)
            set_weight_loader(self.bias, self.weight_loader, self._bias_shape, shard_ids)

    def full_output_rows(self, shard_id: ShardId) -> int:
        """Rows of the checkpoint tensor for ``shard_id`` (packed layers override)."""
        return self.full_output

    def _weight_shape(self, shard_id: ShardId) -> tuple[int, ...]:
        return (self.full_output_rows(shard_id), self.full_input)

    def _bias_shape(self, shard_id: ShardId) -> tuple[int, ...]:
        return (self.full_output_rows(shard_id),)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        raise NotImplementedError


class ReplicatedLinear(_LinearBase):
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
    ) -> None:
        super().__init__(
            input_size,
            output_size,
            bias=bias,
            parallel=parallel,
            dtype=dtype,
            device=device,
            full_input=input_size,
            full_output=output_size,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(_LinearBase):
    """``y = x W^T + b`` with W's output rows split across ranks; output stays split."""

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
        shard_ids: Sequence[ShardId] = (None,),
    ) -> None:
        per_rank = divide(output_size, parallel.world_size, what)
        super().__init__(
            input_size,
            per_rank,
            bias=bias,
            parallel=parallel,
            dtype=dtype,
            device=device,
            full_input=input_size,
            full_output=output_size,
            shard_ids=shard_ids,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        assert shard_id is None, "ColumnParallelLinear holds a single checkpoint tensor"
        size = param.shape[0]
        copy_checked(param.data, loaded_weight.narrow(0, self.parallel.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
    ) -> None:
        self.output_sizes = tuple(output_sizes)
        for size in self.output_sizes:
            divide(size, parallel.world_size, what)
        super().__init__(
            input_size,
            sum(self.output_sizes),
            parallel=parallel,
            dtype=dtype,
            device=device,
            bias=bias,
            what=what,
            shard_ids=tuple(range(len(self.output_sizes))),
        )

    def full_output_rows(self, shard_id: ShardId) -> int:
        assert isinstance(shard_id, int), f"packed shard id must be an int, got {shard_id!r}"
        return self.output_sizes[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        assert isinstance(shard_id, int), f"packed shard id must be an int, got {shard_id!r}"
        world = self.parallel.world_size
        offset = sum(self.output_sizes[:shard_id]) // world
        size = self.output_sizes[shard_id] // world
        source = loaded_weight.narrow(0, self.parallel.rank * size, size)
        copy_checked(param.data.narrow(0, offset, size), source)


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
    ) -> None:
        world = parallel.world_size
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = divide(num_heads, world, "num_attention_heads")
        self.num_kv_heads = divide(num_kv_heads, world, "num_key_value_heads")
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            (num_heads + 2 * num_kv_heads) * head_dim,
            parallel=parallel,
            dtype=dtype,
            device=device,
            bias=bias,
            shard_ids=("q", "k", "v"),
        )

    def full_output_rows(self, shard_id: ShardId) -> int:
        if shard_id == "q":
            return self.total_num_heads * self.head_dim
        if shard_id in ("k", "v"):
            return self.total_num_kv_heads * self.head_dim
        raise AssertionError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if shard_id == "q":
            offset, size = 0, self.q_size
        elif shard_id == "k":
            offset, size = self.q_size, self.kv_size
        elif shard_id == "v":
            offset, size = self.q_size + self.kv_size, self.kv_size
        else:
            raise AssertionError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        source = loaded_weight.narrow(0, self.parallel.rank * size, size)
        copy_checked(param.data.narrow(0, offset, size), source)


class RowParallelLinear(_LinearBase):
    """``y = x W^T + b`` with W's input columns split: each rank sums a partial product."""

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
    ) -> None:
        per_rank = divide(input_size, parallel.world_size, what)
        super().__init__(
            per_rank,
            output_size,
            bias=bias,
            parallel=parallel,
            dtype=dtype,
            device=device,
            full_input=input_size,
            full_output=output_size,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        assert shard_id is None, "RowParallelLinear holds a single checkpoint tensor"
        if param.dim() == 1:  # the bias is not split; rank 0 adds it once
            copy_checked(param.data, loaded_weight)
            return
        size = param.shape[1]
        copy_checked(param.data, loaded_weight.narrow(1, self.parallel.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.parallel.rank == 0 else None
        return self.parallel.all_reduce(F.linear(x, self.weight, bias))
