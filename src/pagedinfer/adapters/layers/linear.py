"""Tensor-parallel linear layers and the weight loaders that cut a checkpoint into TP shards.

Every parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)`` (see
:func:`set_weight_loader`) that copies *this rank's* slice of a full checkpoint tensor into it,
so the model loader never needs to know how a layer is split.

* column parallel: the output features are split, each rank computes its own columns;
* row parallel: the input features are split, partial outputs are summed (all-reduce);
* packed layers hold several checkpoint tensors side by side (q/k/v, gate/up), addressed by
  a shard id, each one split across ranks on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    "RowParallelLinear",
    "ShardId",
    "WeightLoader",
    "default_weight_loader",
    "divide",
    "get_weight_loader",
    "set_weight_loader",
]

ShardId = str | int | None


class WeightLoader(Protocol):
    def __call__(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None: ...


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
) -> None:
    """Copy a replicated (unsplit) tensor as is."""
    assert shard_id is None, f"an unpacked parameter got shard id {shard_id!r}"
    _copy_checked(param.data, loaded_weight)


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def get_weight_loader(param: nn.Parameter) -> WeightLoader:
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


def divide(total: int, world_size: int, what: str) -> int:
    """``total / world_size``, or a :class:`ConfigurationError` naming ``what`` if uneven."""
    if total % world_size:
        raise ConfigurationError(
            f"{what}={total} is not divisible by tensor_parallel_size={world_size}: "
            f"choose a tensor_parallel_size that divides {total}."
        )
    return total // world_size


def _copy_checked(target: torch.Tensor, source: torch.Tensor) -> None:
    if target.shape != source.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(source.shape)} does not fit a parameter "
            f"(shard) of shape {tuple(target.shape)}"
        )
    target.copy_(source)


class _LinearBase(nn.Module):
    """``weight [output_per_rank, input_per_rank]`` plus an optional bias."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        parallel: ParallelContext,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_LinearBase):
    """``y = x W^T + b`` with W's output rows split across ranks; output stays split."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel: ParallelContext,
        bias: bool = False,
        what: str = "output features",
    ) -> None:
        per_rank = divide(output_size, parallel.world_size, what)
        super().__init__(input_size, per_rank, bias=bias, parallel=parallel)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        assert shard_id is None, "ColumnParallelLinear holds a single checkpoint tensor"
        size = param.shape[0]
        _copy_checked(param.data, loaded_weight.narrow(0, self.parallel.rank * size, size))

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
        bias: bool = False,
    ) -> None:
        self.output_sizes = tuple(output_sizes)
        for size in self.output_sizes:
            divide(size, parallel.world_size, "intermediate_size")
        super().__init__(
            input_size,
            sum(self.output_sizes),
            parallel=parallel,
            bias=bias,
            what="intermediate_size",
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        assert isinstance(shard_id, int), f"packed shard id must be an int, got {shard_id!r}"
        world = self.parallel.world_size
        offset = sum(self.output_sizes[:shard_id]) // world
        size = self.output_sizes[shard_id] // world
        source = loaded_weight.narrow(0, self.parallel.rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), source)


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
        bias: bool = False,
    ) -> None:
        world = parallel.world_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, world, "num_attention_heads")
        self.num_kv_heads = divide(num_kv_heads, world, "num_key_value_heads")
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            (num_heads + 2 * num_kv_heads) * head_dim,
            parallel=parallel,
            bias=bias,
        )

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
        _copy_checked(param.data.narrow(0, offset, size), source)


class RowParallelLinear(_LinearBase):
    """``y = x W^T + b`` with W's input columns split: each rank sums a partial product."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel: ParallelContext,
        bias: bool = False,
        what: str = "input features",
    ) -> None:
        per_rank = divide(input_size, parallel.world_size, what)
        super().__init__(per_rank, output_size, bias=bias, parallel=parallel)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        assert shard_id is None, "RowParallelLinear holds a single checkpoint tensor"
        if param.dim() == 1:  # the bias is not split; rank 0 adds it once
            _copy_checked(param.data, loaded_weight)
            return
        size = param.shape[1]
        _copy_checked(param.data, loaded_weight.narrow(1, self.parallel.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.parallel.rank == 0 else None
        return self.parallel.all_reduce(F.linear(x, self.weight, bias))
