"""The group a model is built for, passed explicitly to every layer: this rank's place in its
tensor-parallel group and, with pipeline parallelism, the stage it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from pagedinfer.adapters.distributed.pipeline import PipelineStage

__all__ = ["SINGLE_PROCESS", "Collectives", "ParallelContext"]


class Collectives(Protocol):
    """One group's collectives (see ``adapters/distributed/group.py``), rank order 0..N-1."""

    def all_reduce(self, tensor: torch.Tensor, *, minimum: bool = False) -> None:
        """Sum (or take the minimum of) ``tensor`` over the group, in place."""
        ...

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` on rank 0, in rank order; None on the other ranks."""
        ...


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """This process's rank in the tensor-parallel group (``world_size == 1``: no group).

    ``group`` carries the engine's own collectives, so that several tensor-parallel engines
    can live in one process; without it, ``torch.distributed``'s default group is used
    (a process launched by ``torchrun`` or ``init_process_group``).

    With pipeline parallelism ``stage`` says which layers this rank's model holds (``None``:
    the whole model) and ``everyone`` is a group of every rank of every stage (gloo, CPU
    tensors), over which :meth:`min_over_ranks` agrees on the KV-cache size: the scheduler has
    one block pool, so every stage must hold the same number of blocks.
    """

    rank: int = 0
    world_size: int = 1
    group: Collectives | None = field(default=None, compare=False, repr=False)
    stage: PipelineStage | None = None
    everyone: Collectives | None = field(default=None, compare=False, repr=False)

    @property
    def is_driver(self) -> bool:
        """Rank 0 of the last stage samples; other ranks mirror its compute."""
        return self.rank == 0 and (self.stage is None or self.stage.is_last)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place."""
        if self.world_size > 1:
            if self.group is not None:
                self.group.all_reduce(tensor)
            else:
                dist.all_reduce(tensor)
        return tensor

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` any rank holds (every rank must call it)."""
        if self.everyone is not None:
            agreed = torch.tensor([value], dtype=torch.int64)
            self.everyone.all_reduce(agreed, minimum=True)
            return int(agreed.item())
        if self.world_size == 1:
            return value
        agreed = torch.tensor([value], dtype=torch.int64, device=device)
        if self.group is not None:
            self.group.all_reduce(agreed, minimum=True)
        else:
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        return int(agreed.item())

    def gather_to_driver(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``tensor`` along ``dim`` on rank 0; other ranks get None."""
        if self.world_size == 1:
            return tensor
        if self.group is not None:
            gathered = self.group.gather(tensor.contiguous())
            return torch.cat(gathered, dim=dim) if gathered is not None else None
        parts = (
            [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == 0 else None
        )
        dist.gather(tensor.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=dim) if parts is not None else None


SINGLE_PROCESS = ParallelContext()
