"""A stalled (SIGSTOPped) tensor-parallel worker: a clear error within ``worker_timeout_s``.

Before issue 11.8 the step blocked for gloo's 300 s and then raised a bare ``RuntimeError``;
and the next step waited forever on the control channel, which had no timeout.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedinfer import Engine, SamplingParams
from pagedinfer.errors import ConfigurationError, WorkerDiedError, WorkerTimeoutError

from .tp_helpers import child_pids, existing_shm, tracked_shm_names

pytestmark = [pytest.mark.tensor_parallel, pytest.mark.slow]

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TIMEOUT_S = 3.0
SETTINGS = {"device": "cpu", "kv_block_size": 16, "max_model_len": 64, "num_kv_blocks": 8}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny")


def test_a_stopped_worker_raises_within_the_timeout(checkpoint: Path) -> None:
    children_before = child_pids()
    active_before = {child.pid for child in multiprocessing.active_children()}
    with tracked_shm_names() as created:
        engine = Engine(checkpoint, tensor_parallel_size=2, worker_timeout_s=TIMEOUT_S, **SETTINGS)
        (output,) = engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert output.outputs[0].finish_reason == "length"
        (worker,) = {child.pid for child in multiprocessing.active_children()} - active_before
        assert worker is not None
        os.kill(worker, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(WorkerTimeoutError) as error:
                engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
            waited = time.monotonic() - started
            message = str(error.value)
            assert f"worker_timeout_s={TIMEOUT_S}" in message
            assert f"rank 1 (pid {worker}) is stopped" in message
            assert TIMEOUT_S <= waited < TIMEOUT_S + 15  # + the grace for a dying worker
            assert isinstance(error.value, WorkerDiedError)  # `except WorkerDiedError` holds
            # And it stays failed, without waiting.
            with pytest.raises(WorkerTimeoutError, match=f"worker_timeout_s={TIMEOUT_S}"):
                engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
            assert not engine.has_unfinished_requests()
        finally:
            if _alive(worker):
                os.kill(worker, signal.SIGCONT)
            engine.close()
        assert child_pids() <= children_before
        assert not existing_shm(created)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), True])
def test_the_timeout_is_validated(checkpoint: Path, timeout: object) -> None:
    with pytest.raises(ConfigurationError, match="worker_timeout_s"):
        Engine(checkpoint, worker_timeout_s=timeout, **SETTINGS)  # type: ignore[arg-type]
