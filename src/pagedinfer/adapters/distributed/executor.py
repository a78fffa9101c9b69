"""``TensorParallelExecutor``: rank 0 in this process, ranks 1..N-1 in spawned workers.

Start-up: check that the model splits evenly, host a private TCP store on a free port,
create the control channel (a uniquely named shared-memory segment), spawn one worker per
extra rank, wait until each has started, join the group (gloo on the CPU, NCCL on CUDA),
build rank 0's :class:`ModelRunner` and wait until every worker's runner is ready. The
runners agree on the KV-cache size inside their constructors (the minimum over ranks).

Each step: check the workers are alive, send ``("execute", plan)`` through the channel,
run rank 0's share of the step; the model's collectives keep all ranks in lock step. Any
failure during a step leaves the ranks out of step, so the executor then stops its workers
and every later call raises :class:`WorkerDiedError`. If a worker died, that is the error
raised, with the worker's exit status and, when it had one, its traceback.

``close()``, garbage collection and interpreter exit all end in the same release (a
``weakref.finalize``): ask the workers to shut down, join them (terminate them if they do
not exit in time), free rank 0's runner and unlink the shared memory.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch._C._distributed_c10d import TCPStore

from pagedinfer.adapters.collective_rpc import RpcMethod, call_on_runner, pack_call
from pagedinfer.adapters.distributed.channel import ChannelWriter
from pagedinfer.adapters.distributed.group import LOCALHOST, ProcessGroupCollectives, host_store
from pagedinfer.adapters.distributed.messages import (
    READY,
    RPC_RESULT,
    STARTED,
    execute_message,
    rpc_message,
    shutdown_message,
    sleep_message,
    wake_up_message,
)
from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.distributed.worker import WorkerSpec
from pagedinfer.adapters.distributed.worker_handle import WorkerHandle, first_dead
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.registry import read_model_config
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.adapters.sampling.grammar import GrammarCompiler
from pagedinfer.domain.executor import launch_now
from pagedinfer.domain.kv_groups import KVGroupSpec
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.step_output import StepOutput
from pagedinfer.errors import (
    CollectiveRpcError,
    ConfigurationError,
    EngineClosedError,
    PagedInferError,
    WorkerDiedError,
    WorkerTimeoutError,
)

__all__ = [
    "DEFAULT_CHANNEL_BYTES",
    "DEFAULT_TIMEOUT_S",
    "TensorParallelExecutor",
    "check_tensor_parallel_split",
    "rank_devices",
]

_T = TypeVar("_T")

DEFAULT_CHANNEL_BYTES = 1 << 20
"""Initial control-channel segment (it grows when a step's message does not fit)."""
DEFAULT_TIMEOUT_S = 300.0
"""Collective and store timeout while starting (rendezvous, loading, sizing the cache). Once
serving, a step waits at most ``RunnerConfig.worker_timeout_s`` for a stalled peer."""
STARTUP_TIMEOUT_S = 600.0
"""How long a live worker may take to import, load its shard and size its KV cache."""
DEATH_GRACE_S = 5.0
"""After a failed step, how long to wait for a dying worker's exit to become visible."""
SHUTDOWN_GRACE_S = 10.0
"""How long ``close()`` waits for workers to exit on their own before terminating them."""


def check_tensor_parallel_split(config: ModelConfig, world_size: int) -> None:
    """Raise :class:`ConfigurationError` unless every split dimension divides evenly."""
    config.check_tensor_parallel(world_size)


def rank_devices(device: torch.device, world_size: int) -> list[torch.device]:
    """Rank r's device: the CPU for every rank, or ``cuda:(i + r)`` from ``device = cuda:i``."""
    if device.type != "cuda":
        return [device] * world_size
    first = device.index or 0
    visible = torch.cuda.device_count()
    if first + world_size > visible:
        raise ConfigurationError(
            f"tensor_parallel_size={world_size} needs {world_size} GPUs starting at "
            f"cuda:{first}, but {visible} are visible: lower tensor_parallel_size or make "
            "more GPUs visible (CUDA_VISIBLE_DEVICES)."
        )
    return [torch.device("cuda", first + rank) for rank in range(world_size)]


class _Group:
    """Everything the executor must release, kept apart so that a finalizer can hold it
    without keeping the executor alive."""

    def __init__(self) -> None:
        self.store: TCPStore | None = None
        self.channel: ChannelWriter | None = None
        self.workers: list[WorkerHandle] = []
        self.group: ProcessGroupCollectives | None = None
        self.runner: ModelRunner | None = None
        self.healthy = False  # True once started; False again after a failed step
        self.owner_pid = os.getpid()

    def check_workers(self) -> None:
        for worker in self.workers:
            worker.check_alive()

    def release(self) -> None:
        """Stop the workers and free every resource (run once, by the finalizer)."""
        if os.getpid() != self.owner_pid:
            # A forked copy of the caller's process exiting: the workers and the segment
            # belong to the original process, which is still using them.
            return
        graceful = self.healthy and self.channel is not None
        self.healthy = False
        if graceful:
            assert self.channel is not None
            try:
                self.channel.send(
                    shutdown_message(), check=self.check_workers, timeout=SHUTDOWN_GRACE_S
                )
            except Exception:
                graceful = False  # a worker is gone or stuck: terminate them below
        try:
            for worker in self.workers:
                worker.stop(SHUTDOWN_GRACE_S if graceful else 0.0)
            if self.runner is not None:
                self.runner.close()
                self.runner = None
            if self.group is not None:
                self.group.close(abort=not graceful)
                self.group = None
        finally:  # whatever failed above, the shared memory must not outlive the engine
            if self.channel is not None:
                self.channel.close()
                self.channel = None
            self.store = None


class TensorParallelExecutor:
    """Runs each ``BatchPlan`` on ``tensor_parallel_size`` ranks; rank 0 samples.

    ``channel_bytes`` is the initial size of the control channel and ``timeout_s`` the
    collective timeout; ``None`` means :data:`DEFAULT_CHANNEL_BYTES` and
    :data:`DEFAULT_TIMEOUT_S` (read at construction, so tests can shrink them).
    """

    num_kv_blocks: int
    kv_groups: tuple[KVGroupSpec, ...] = ()
    num_host_kv_blocks = 0  # no host KV tier with several ranks (engine/kv_offloading.py)
    # Runs each step to its end before the next: the engine fills in carried tokens.
    reads_carried_tokens = False

    def __init__(
        self,
        config: RunnerConfig,
        *,
        channel_bytes: int | None = None,
        timeout_s: float | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self._grammars = grammars  # structured outputs: rank 0 (the sampling rank) only
        world_size = config.tensor_parallel_size
        if world_size < 2:
            raise ConfigurationError(
                f"TensorParallelExecutor needs tensor_parallel_size >= 2, got {world_size}: "
                "use ModelRunner for a single rank."
            )
        # Refuse before any process starts: these checks are what the workers would hit.
        model_config = read_model_config(config.model_path)
        check_tensor_parallel_split(model_config, world_size)
        model_config.check_max_model_len(config.max_model_len)
        devices = rank_devices(config.device, world_size)
        self._group = _Group()
        # (error class, message) raised again by every later call. Not the exception itself:
        # its traceback would tie this executor into a reference cycle (see execute).
        self._failure: tuple[type[WorkerDiedError], str] | None = None
        self._step_timeout_s = config.worker_timeout_s
        self._finalizer = weakref.finalize(self, self._group.release)
        try:
            self._start(
                config,
                devices,
                DEFAULT_CHANNEL_BYTES if channel_bytes is None else channel_bytes,
                DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
            )
        except BaseException as error:
            died = self._dead_worker_error(error, grace=DEATH_GRACE_S)
            self._finalizer()
            if died is None or died is error:
                died = None
                raise
            try:
                raise died from error
            finally:
                died = None  # no reference cycle through this frame (see execute)

    @property
    def world_size(self) -> int:
        return len(self._group.workers) + 1

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [worker.pid for worker in self._group.workers if worker.pid is not None]

    @property
    def channel_capacity(self) -> int:
        """Current size of the control channel's segment in bytes (it only grows)."""
        channel = self._group.channel
        if channel is None:
            raise EngineClosedError("the tensor-parallel executor is closed")
        return channel.capacity

    def launch(self, plan: BatchPlan) -> Callable[[], StepOutput]:
        """:meth:`execute` now, its output handed back by the returned callable (steps do
        not overlap here)."""
        return launch_now(self.execute, plan)

    def execute(self, plan: BatchPlan) -> StepOutput:
        """Run one step on every rank; return rank 0's output."""
        return self._on_every_rank(execute_message(plan), lambda runner: runner.execute(plan))

    @property
    def is_sleeping(self) -> bool:
        runner = self._group.runner
        return runner is not None and runner.is_sleeping

    def sleep(self, level: int = 1) -> None:
        """Every rank frees its KV cache (and weights: level 2; ``adapters/sleep_mode.py``)."""
        self._on_every_rank(sleep_message(level), lambda runner: runner.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Every rank takes back what :meth:`sleep` freed (``tags``: which halves)."""
        self._on_every_rank(wake_up_message(tags), lambda runner: runner.wake_up(tags))

    def _on_every_rank(self, message: tuple[Any, ...], run: Callable[[ModelRunner], _T]) -> _T:
        """Send ``message`` to the workers, ``run`` rank 0's share; rank 0's result. A
        failure leaves the ranks out of step: the executor stops for good."""
        group = self._group
        if self._failure is not None:
            kind, reason = self._failure
            raise kind(reason)
        runner, channel = group.runner, group.channel
        if runner is None or channel is None:
            raise EngineClosedError("the tensor-parallel executor was used after close()")
        started = time.monotonic()
        try:
            group.check_workers()
            # Waits for the workers to have read the previous step: bounded like a collective.
            channel.send(message, check=group.check_workers, timeout=self._step_timeout_s)
            return run(runner)
        except BaseException as error:
            died = self._stop_after(error, started)
            # Raise without keeping the exception in a local of this frame: the traceback
            # holds the frame, and that cycle would keep everything the frames reference
            # (the channel and its named semaphores) alive until the cycle collector runs.
            if died is None or died is error:
                died = None
                raise
            try:
                raise died from error
            finally:
                died = None

    def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``method`` on every rank (rank 0 here, the workers through the channel,
        ``adapters/collective_rpc.py``); the results in rank order. Rank 0's error is raised
        as it is, a worker's as :class:`CollectiveRpcError` with its traceback; the group
        goes on. A worker that dies, or does not answer within ``timeout`` (None:
        ``worker_timeout_s``), stops the group as a failed step does."""
        group = self._group
        if self._failure is not None:
            kind, message = self._failure
            raise kind(message)
        runner, channel = group.runner, group.channel
        if runner is None or channel is None:
            raise EngineClosedError("the tensor-parallel executor was used after close()")
        call_kwargs = dict(kwargs or {})
        payload = pack_call(method, args, call_kwargs)  # once, for every worker
        limit = self._step_timeout_s if timeout is None else timeout
        started = time.monotonic()
        local_error: Exception | None = None
        try:
            group.check_workers()
            channel.send(rpc_message(payload), check=group.check_workers, timeout=limit)
            try:
                local = call_on_runner(runner, method, args, call_kwargs)
            except Exception as error:  # the workers still answer: collect them first
                local, local_error = None, error
            deadline = time.monotonic() + limit
            replies = [
                worker.await_status(
                    RPC_RESULT,
                    check=group.check_workers,
                    deadline=deadline,
                    late=f"tensor-parallel worker rank {worker.rank} (pid {worker.pid}) did "
                    f"not answer collective_rpc({_describe(method)}) within {limit:g} s; the "
                    "engine cannot continue: close it and create a new Engine (pass a "
                    "larger timeout for slower calls).",
                )
                for worker in group.workers
            ]
        except BaseException as error:
            died = self._stop_after(error, started, limit)
            if died is None or died is error:
                died = None
                raise
            try:
                raise died from error
            finally:
                died = None
        if local_error is not None:
            raise local_error
        results = [local]
        for worker, (_, ok, value) in zip(group.workers, replies, strict=True):
            if not ok:
                raise CollectiveRpcError(
                    f"collective_rpc({_describe(method)}) raised on tensor-parallel rank "
                    f"{worker.rank}; the engine goes on. The worker's error:\n{value}"
                )
            results.append(value)
        return results

    def _stop_after(
        self, error: BaseException, started: float, limit: float | None = None
    ) -> WorkerDiedError | None:
        """``error`` broke a call on every rank: the ranks are out of step now and nothing
        can continue on this group. Stop it; the error to raise instead (None: ``error``)."""
        limit = self._step_timeout_s if limit is None else limit
        grace = DEATH_GRACE_S if isinstance(error, Exception) else 0.0
        died = self._dead_worker_error(error, grace=grace)
        if died is None and (
            isinstance(error, TimeoutError) or time.monotonic() - started >= limit
        ):
            died = self._stalled_worker_error()
        self._failure = (
            (type(died), str(died))
            if died is not None
            else (
                WorkerDiedError,
                "the tensor-parallel workers were stopped after a step failed on rank 0 "
                f"({error!r}); create a new Engine.",
            )
        )
        self._group.healthy = False
        self._finalizer()
        return died

    def _stalled_worker_error(self) -> WorkerTimeoutError:
        states = ", ".join(
            f"rank {worker.rank} (pid {worker.pid}) {_process_state(worker.pid)}"
            for worker in self._group.workers
        )
        return WorkerTimeoutError(
            f"a tensor-parallel step waited more than worker_timeout_s={self._step_timeout_s} s "
            f"for its workers ({states}); a worker is stopped or hung. The engine cannot "
            "continue: close it and create a new Engine (raise worker_timeout_s if steps "
            "legitimately take longer)."
        )

    def close(self) -> None:
        """Shut the workers down, free rank 0's runner, unlink the channel. Idempotent."""
        self._finalizer()

    # ------------------------------------------------------------------ start-up
    def _start(
        self,
        config: RunnerConfig,
        devices: list[torch.device],
        channel_bytes: int,
        timeout_s: float,
    ) -> None:
        group = self._group
        world_size = len(devices)
        timeout = timedelta(seconds=timeout_s)
        group.store = host_store(world_size, timeout)
        context = multiprocessing.get_context("spawn")
        num_workers = world_size - 1
        group.channel = ChannelWriter(
            [context.Semaphore(0) for _ in range(num_workers)],
            [context.Semaphore(0) for _ in range(num_workers)],
            capacity=channel_bytes,
        )
        for rank in range(1, world_size):
            status_reader, status_writer = context.Pipe(duplex=False)
            spec = WorkerSpec(
                rank=rank,
                config=replace(config, device=devices[rank]),
                store_host=LOCALHOST,
                store_port=group.store.port,
                timeout_s=timeout_s,
                channel=group.channel.endpoint(rank - 1),
                status=status_writer,
            )
            group.workers.append(WorkerHandle(context, spec, status_reader))
            # The worker holds its own copy now; ours would hide the pipe's end-of-file.
            status_writer.close()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for worker in group.workers:
            worker.await_status(STARTED, check=group.check_workers, deadline=deadline)
        group.group = ProcessGroupCollectives(
            group.store, rank=0, world_size=world_size, device=devices[0], timeout=timeout
        )
        parallel = ParallelContext(0, world_size, group.group)
        group.runner = ModelRunner(
            replace(config, device=devices[0]), parallel, grammars=self._grammars
        )
        for worker in group.workers:
            ready = worker.await_status(READY, check=group.check_workers, deadline=deadline)
            # Every rank agreed on the pool's size and groups the whole model alike.
            assert ready[1:] == (group.runner.num_kv_blocks, group.runner.kv_groups), ready
        self.num_kv_blocks = group.runner.num_kv_blocks
        self.kv_groups = group.runner.kv_groups
        group.group.step_timeout = timedelta(seconds=config.worker_timeout_s)
        group.healthy = True

    def _dead_worker_error(self, error: BaseException, *, grace: float) -> WorkerDiedError | None:
        """The error to raise for ``error`` if a worker died (now or within ``grace`` s)."""
        if isinstance(error, WorkerDiedError):
            return error
        if isinstance(error, PagedInferError):
            return None  # raised on purpose by rank 0 (e.g. a configuration error): keep it
        dead = first_dead(self._group.workers, grace) if self._group.workers else None
        return dead.died_error() if dead is not None else None


_PROCESS_STATES = {
    "R": "is running",
    "S": "is waiting",
    "D": "is in an uninterruptible wait",
    "T": "is stopped (SIGSTOP?)",
    "t": "is stopped by a debugger",
    "Z": "has exited",
}


def _describe(method: RpcMethod) -> str:
    return repr(method) if isinstance(method, str) else getattr(method, "__name__", "a callable")


def _process_state(pid: int | None) -> str:
    """What Linux says process ``pid`` is doing ("" where /proc is not available)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "is alive"
    state = stat.rsplit(")", 1)[-1].split()[0]  # the name may contain spaces and ')'
    return _PROCESS_STATES.get(state, f"is in state {state!r}")
