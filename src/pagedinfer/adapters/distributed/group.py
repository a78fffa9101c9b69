"""One engine's own ``torch.distributed`` group: a TCP store and a gloo or NCCL backend.

``torch.distributed.init_process_group`` sets up one *default* group per process, so two
tensor-parallel engines in one process (rank 0 of both lives in the caller's process) could
not each have their own. Instead every engine builds a private store and backend and calls
the backend's collectives directly; nothing is registered globally, and a process that also
uses ``torch.distributed`` for something else is not disturbed.

Rank 0 hosts the store on a port the OS picks (port 0), so engines never fight over a fixed
rendezvous port: on the loopback interface for the local (``mp``) executor, on its node's IP
address for the Ray executor (``ray_executor.py``), whose ranks may be on other machines.
Every collective has a timeout (``step_timeout`` once the engine serves, the engine's
``worker_timeout_s``): a peer that hangs or is stopped turns into an error instead of a hung
engine (a peer that *dies* is noticed much sooner, see ``executor.py``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol, cast

import torch
from torch._C._distributed_c10d import (
    AllreduceOptions,
    Backend,
    GatherOptions,
    ProcessGroupGloo,
    ReduceOp,
    Store,
    TCPStore,
    Work,
)

__all__ = ["ProcessGroupCollectives", "connect_store", "host_store"]

LOCALHOST = "127.0.0.1"


class _CollectiveBackend(Protocol):
    """The collectives of a ``torch.distributed`` backend object that this module calls.

    Backends (``ProcessGroupGloo``, ``ProcessGroupNCCL``) have these methods at run time;
    torch's type stubs declare them only on ``ProcessGroup``.
    """

    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> Work: ...

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: GatherOptions,
    ) -> Work: ...


def host_store(world_size: int, timeout: timedelta, host: str = LOCALHOST) -> TCPStore:
    """Rank 0's store on a free port (``.port``); the others reach it at ``host``."""
    return TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def connect_store(host: str, port: int, world_size: int, timeout: timedelta) -> TCPStore:
    """A worker's connection to rank 0's store."""
    return TCPStore(host, port, world_size, is_master=False, timeout=timeout)


class ProcessGroupCollectives:
    """The :class:`~pagedinfer.adapters.distributed.parallel.Collectives` of one engine.

    CUDA devices use NCCL, the CPU uses gloo. Construction is a rendezvous: it returns once
    all ``world_size`` ranks have joined through ``store`` (or fails after ``timeout``).
    ``host`` is the address gloo binds this rank to (``None``: what the host name resolves
    to); ranks on several machines pass their node's address.
    """

    def __init__(
        self,
        store: Store,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout: timedelta,
        host: str | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend_name = "nccl" if device.type == "cuda" else "gloo"
        backend: Backend
        if device.type == "cuda":
            # NCCL binds its communicators to the current device: make that this rank's GPU
            # before the group exists, or every rank could end up on cuda:0. (The GPU path is
            # not exercised by the CPU test suite; see docs/tensor-parallelism.md.)
            torch.cuda.set_device(device)
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend = ProcessGroupNCCL(store, rank, world_size, options)
        elif host is not None:
            options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = timeout
            options._devices = [ProcessGroupGloo.create_device(hostname=host)]
            options._threads = 2  # what the constructor without options uses for one device
            backend = ProcessGroupGloo(store, rank, world_size, options)
        else:
            backend = ProcessGroupGloo(store, rank, world_size, timeout)
        self._backend: Backend | None = backend
        # Per-collective timeout once serving (``worker_timeout_s``); until then (loading,
        # sizing the cache) the construction timeout, which allows for a slow start.
        self.step_timeout: timedelta | None = None

    def all_reduce(self, tensor: torch.Tensor, *, minimum: bool = False) -> None:
        """Sum (or take the minimum of) ``tensor`` over the group, in place."""
        options = AllreduceOptions()
        options.reduceOp = ReduceOp(ReduceOp.MIN if minimum else ReduceOp.SUM)
        if self.step_timeout is not None:
            options.timeout = self.step_timeout
        self._live_backend().allreduce([tensor], options).wait()

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` on rank 0, in rank order; None on the other ranks."""
        options = GatherOptions()
        options.rootRank = 0
        if self.step_timeout is not None:
            options.timeout = self.step_timeout
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            self._live_backend().gather([parts], [tensor], options).wait()
            return parts
        self._live_backend().gather([], [tensor], options).wait()
        return None

    def close(self, *, abort: bool = False) -> None:
        """Drop the backend. NCCL: release its communicators (``abort``: without waiting for
        pending work, after a peer failed). Safe to call twice."""
        backend, self._backend = self._backend, None
        if backend is not None and self.backend_name == "nccl":
            if abort:
                backend.abort()
            else:
                backend.shutdown()

    def _live_backend(self) -> _CollectiveBackend:
        if self._backend is None:
            raise RuntimeError("the tensor-parallel group was used after close()")
        return cast(_CollectiveBackend, self._backend)
