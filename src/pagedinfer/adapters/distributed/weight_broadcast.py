"""Weights from a trainer in another process: a process group of the trainer and every
engine rank, one broadcast per tensor (docs/rl.md, "A trainer in another process").

The trainer is rank 0 of its own group (gloo on the CPU, NCCL on GPUs); engine rank ``r``
joins as rank ``1 + r``. Nothing here is global: the group is built on a TCP store the
trainer hosts and kept on each engine rank's runner, so the engine's own tensor-parallel
group is untouched. The engine side runs through ``collective_rpc``::

    group = TrainerGroup(host, port, world_size=1 + engine_ranks)
    # trainer process                          # engine process
    sender = join_as_trainer(group)            engine.collective_rpc(join_trainer_group,
                                                                     args=(group,))
    metas = describe(named_tensors)            (the same list, sent to the engine by any means)
    send_weights(sender, named_tensors)        engine.collective_rpc(receive_weights,
                                                                     args=(group, metas))
                                               engine.reset_prefix_cache()

:func:`receive_weights` checks every name, dtype and shape first, as ``update_weights`` does,
then receives one tensor at a time and writes it at once (each rank its shard): the extra
memory is one tensor. If the check fails it still receives (and drops) every tensor, so the
trainer's broadcasts never wait forever, and then raises
:class:`~pagedinfer.errors.WeightUpdateError` with nothing written.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch._C._distributed_c10d import BroadcastOptions, TCPStore

from pagedinfer.adapters.distributed.group import ProcessGroupCollectives, connect_store
from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.models.weight_update import (
    TensorMeta,
    UpdatableRunner,
    check_update,
    safetensors_dtype,
    write_update,
)
from pagedinfer.errors import WeightUpdateError

__all__ = [
    "BroadcastMeta",
    "EngineRank",
    "Membership",
    "TrainerGroup",
    "describe",
    "join_as_trainer",
    "join_trainer_group",
    "leave_trainer_group",
    "receive_weights",
    "send_weights",
]

_GROUPS_ATTRIBUTE = "_trainer_groups"


@dataclass(frozen=True, slots=True)
class TrainerGroup:
    """Where the trainer's group meets: its TCP store (hosted by the trainer) and size."""

    host: str
    port: int
    world_size: int  # the trainer + every engine rank
    timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class BroadcastMeta:
    """One tensor the trainer broadcasts: its checkpoint name, torch dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def describe(weights: Iterable[tuple[str, torch.Tensor]]) -> list[BroadcastMeta]:
    """The metadata both sides need, in broadcast order."""
    return [BroadcastMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in weights]


class EngineRank(UpdatableRunner, Protocol):
    """What the engine-side functions need of a rank's runner (``ModelRunner``)."""

    @property
    def parallel(self) -> ParallelContext: ...

    @property
    def device(self) -> torch.device: ...


@dataclass(slots=True)
class Membership:
    """One process's place in a trainer group: the store connection and the backend."""

    store: TCPStore
    collectives: ProcessGroupCollectives

    def close(self) -> None:
        self.collectives.close()


def _join(group: TrainerGroup, rank: int, device: torch.device) -> Membership:
    timeout = timedelta(seconds=group.timeout_s)
    if rank == 0:
        store = TCPStore(
            group.host, group.port, group.world_size, is_master=True, timeout=timeout,
            wait_for_workers=False,
        )  # fmt: skip
    else:
        store = connect_store(group.host, group.port, group.world_size, timeout)
    collectives = ProcessGroupCollectives(
        store, rank=rank, world_size=group.world_size, device=device, timeout=timeout
    )
    return Membership(store, collectives)


def join_as_trainer(group: TrainerGroup, device: torch.device | str = "cpu") -> Membership:
    """The trainer's side (rank 0): host the store at ``group.port`` and join; returns once
    every engine rank joined too (``join_trainer_group``)."""
    return _join(group, 0, torch.device(device))


def send_weights(sender: Membership, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Broadcast each tensor from the trainer (rank 0), in order, to every engine rank."""
    for _, tensor in weights:
        _broadcast(sender.collectives, tensor.detach().contiguous())


def _memberships(runner: EngineRank) -> dict[TrainerGroup, Membership]:
    groups: dict[TrainerGroup, Membership] = vars(runner).setdefault(_GROUPS_ATTRIBUTE, {})
    return groups


def join_trainer_group(runner: EngineRank, group: TrainerGroup) -> int:
    """``collective_rpc`` function: this engine rank joins ``group`` as ``1 + rank``; its
    rank in the group."""
    rank = 1 + runner.parallel.rank
    groups = _memberships(runner)
    if group not in groups:
        groups[group] = _join(group, rank, runner.device)
    return rank


def leave_trainer_group(runner: EngineRank, group: TrainerGroup) -> None:
    """``collective_rpc`` function: drop this rank's membership of ``group``."""
    membership = _memberships(runner).pop(group, None)
    if membership is not None:
        membership.close()


def receive_weights(runner: EngineRank, group: TrainerGroup, metas: Sequence[BroadcastMeta]) -> int:
    """``collective_rpc`` function: receive ``metas``' tensors from the trainer and write
    each (see the module docstring); the number written on this rank."""
    membership = _memberships(runner).get(group)
    if membership is None:
        raise WeightUpdateError(
            f"receive_weights: this engine rank has not joined {group}: call "
            "collective_rpc(join_trainer_group, args=(group,)) first."
        )
    collectives, device = membership.collectives, runner.device
    refused: WeightUpdateError | None = None
    try:
        check_update(
            runner, [TensorMeta(m.name, safetensors_dtype(m.dtype), m.shape) for m in metas]
        )
    except WeightUpdateError as error:
        refused = error
    written = 0
    for meta in metas:
        buffer = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        _broadcast(collectives, buffer)
        if refused is None:
            written += write_update(runner, [(meta.name, buffer)])
    if refused is not None:
        raise refused
    return written


def _broadcast(collectives: ProcessGroupCollectives, tensor: torch.Tensor) -> None:
    options = BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    backend: Any = collectives._live_backend()
    backend.broadcast([tensor], options).wait()
