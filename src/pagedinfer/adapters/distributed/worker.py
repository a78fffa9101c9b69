"""A tensor-parallel worker process (ranks 1..N-1): mirror rank 0, step by step.

:func:`run_worker` is the entry point of a process started with the ``spawn`` method. It
joins the engine's group, builds this rank's :class:`ModelRunner` (its shard of the weights
and of the KV cache), reports ``ready`` and then executes every plan rank 0 sends until it is
told to shut down. Collectives inside the model keep the ranks in lock step; the control
channel only says *what* to run.

A worker never outlives its engine: it exits when rank 0's process is gone (checked while
it waits for a message, and a collective with a dead peer fails), and on any exception it
reports the traceback to rank 0 and exits with status 1.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch

from pagedinfer.adapters.collective_rpc import call_on_runner, unpack_call
from pagedinfer.adapters.distributed.channel import ChannelError, ChannelReader, ReaderEndpoint
from pagedinfer.adapters.distributed.group import ProcessGroupCollectives, connect_store
from pagedinfer.adapters.distributed.messages import (
    EXECUTE,
    FAILED,
    READY,
    RPC,
    RPC_RESULT,
    SHUTDOWN,
    SLEEP,
    STARTED,
    WAKE_UP,
)
from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.adapters.runner_config import RunnerConfig

__all__ = ["WorkerSpec", "run_worker"]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, pickled into the new process when it starts."""

    rank: int
    config: RunnerConfig  # this rank's device
    store_host: str
    store_port: int
    timeout_s: float  # collectives and the store
    channel: ReaderEndpoint
    status: Connection  # write end of this worker's status pipe to rank 0


class _ParentExited(Exception):
    """Rank 0's process is gone: nobody is left to serve."""


def run_worker(spec: WorkerSpec) -> None:
    """Process entry point: serve rank 0 until ``shutdown``; exit 1 after reporting an error."""
    # Ctrl-C reaches the whole process group; rank 0 decides how the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve(spec)
    except _ParentExited:
        pass
    except BaseException:
        _report(spec.status, (FAILED, traceback.format_exc()))
        spec.status.close()
        sys.exit(1)
    spec.status.close()


def _serve(spec: WorkerSpec) -> None:
    config = spec.config
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    elif config.device.type == "cpu":
        # Ranks share the host's cores; more threads per rank only oversubscribes them.
        torch.set_num_threads(1)
    parent = multiprocessing.parent_process()

    def check_parent() -> None:
        if parent is not None and not parent.is_alive():
            raise _ParentExited

    timeout = timedelta(seconds=spec.timeout_s)
    reader = ChannelReader(spec.channel)
    group: ProcessGroupCollectives | None = None
    runner: ModelRunner | None = None
    try:
        store = connect_store(
            spec.store_host, spec.store_port, config.tensor_parallel_size, timeout
        )
        spec.status.send((STARTED,))
        group = ProcessGroupCollectives(
            store,
            rank=spec.rank,
            world_size=config.tensor_parallel_size,
            device=config.device,
            timeout=timeout,
        )
        parallel = ParallelContext(spec.rank, config.tensor_parallel_size, group)
        runner = ModelRunner(config, parallel)
        spec.status.send((READY, runner.num_kv_blocks, runner.kv_groups))
        group.step_timeout = timedelta(seconds=config.worker_timeout_s)
        while True:
            message = reader.receive(check=check_parent)
            command = message[0]
            if command == EXECUTE:
                output = runner.execute(message[1])
                assert not output.sampled_token_ids, "only rank 0 samples"
            elif command == SLEEP:
                runner.sleep(message[1])
            elif command == WAKE_UP:
                runner.wake_up(message[1])
            elif command == RPC:
                _answer_rpc(spec.status, runner, message[1])
            elif command == SHUTDOWN:
                return
            else:
                raise ChannelError(f"unknown control message {command!r}")
    finally:
        if runner is not None:
            runner.close()
        if group is not None:
            group.close()
        reader.close()


def _answer_rpc(status: Connection, runner: ModelRunner, payload: bytes) -> None:
    """Run one ``collective_rpc`` call and send its result, or its error, to rank 0."""
    try:
        method, args, kwargs = unpack_call(payload)
        status.send((RPC_RESULT, True, call_on_runner(runner, method, args, kwargs)))
    except Exception:  # the call raised, or its result cannot be pickled: nothing was sent
        status.send((RPC_RESULT, False, traceback.format_exc()))


def _report(status: Connection, message: tuple[Any, ...]) -> None:
    with contextlib.suppress(OSError):  # rank 0 already closed its end
        status.send(message)
