"""Rank 0's view of one worker process: a worker that fails says why before it exits."""

from __future__ import annotations

import multiprocessing
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from pagedinfer.adapters.distributed.channel import ChannelWriter
from pagedinfer.adapters.distributed.group import LOCALHOST, host_store
from pagedinfer.adapters.distributed.messages import READY, STARTED
from pagedinfer.adapters.distributed.worker import WorkerSpec
from pagedinfer.adapters.distributed.worker_handle import WorkerHandle
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.errors import WorkerDiedError

pytestmark = [pytest.mark.tensor_parallel]


def no_check() -> None:
    return None


def test_a_worker_that_fails_reports_its_traceback(tiny_checkpoint: Path) -> None:
    context = multiprocessing.get_context("spawn")
    store = host_store(2, timedelta(seconds=30))
    writer = ChannelWriter([context.Semaphore(0)], [context.Semaphore(0)], capacity=256)
    status_reader, status_writer = context.Pipe(duplex=False)
    config = RunnerConfig(
        model_path=str(tiny_checkpoint),
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=16,
        attention_backend="torch",
        max_model_len=128,
        num_kv_blocks=16,
        tensor_parallel_size=2,
    )
    spec = WorkerSpec(
        rank=1,
        config=config,
        store_host=LOCALHOST,
        store_port=store.port,
        timeout_s=1.0,
        channel=writer.endpoint(0),
        status=status_writer,
    )
    worker = WorkerHandle(context, spec, status_reader)
    status_writer.close()
    try:
        worker.await_status(STARTED, check=no_check, deadline=time.monotonic() + 60)
        # Rank 0 never joins the group: the worker's rendezvous times out after 1 s.
        with pytest.raises(
            WorkerDiedError,
            match=r"(?s)rank 1 \(pid \d+\) exited with status 1.*The worker's error:\nTraceback",
        ):
            worker.await_status(READY, check=no_check, deadline=time.monotonic() + 60)
    finally:
        worker.stop(1.0)
        writer.close()
    assert not worker.is_alive()
