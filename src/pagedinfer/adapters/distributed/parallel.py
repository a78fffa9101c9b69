"""The tensor-parallel group a model is built for, passed explicitly to every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["SINGLE_PROCESS", "ParallelContext"]


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """This process's rank in the tensor-parallel group (``world_size == 1``: no group)."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and talks to the scheduler; other ranks mirror its compute."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place."""
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def gather_to_driver(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``tensor`` along ``dim`` on rank 0; other ranks get None."""
        if self.world_size == 1:
            return tensor
        parts = (
            [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == 0 else None
        )
        dist.gather(tensor.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=dim) if parts is not None else None


SINGLE_PROCESS = ParallelContext()
