"""The failure policy of a step whose executor raises (issue 21, item 3).

An ordinary exception fails the requests that had a row in the step: they end with
``finish_reason="abort"``, whoever waits for them gets ``StepFailedError`` (the executor's
exception chained), their KV blocks are freed, and every other request carries on. A fatal
failure (a worker gone, a device error) or ``max_consecutive_failed_steps`` failures in a row
make the engine dead: ``EngineDeadError`` from then on. Before, any executor exception left
the step's requests to be planned again (so a request that crashes the sampler crashed every
step), and an ``AsyncEngine`` died silently on the first one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer import AsyncEngine, Engine, RequestOutput, SamplingParams
from pagedinfer.engine.failures import is_fatal
from pagedinfer.errors import EngineDeadError, StepFailedError, WorkerDiedError

from .bounded import within

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
KWARGS: dict[str, Any] = {"device": "cpu", "kv_block_size": 16, "max_model_len": 64}


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Callable[[list[int]], list[int]]:
    engine = Engine(checkpoint, **KWARGS)
    cache: dict[tuple[int, ...], list[int]] = {}

    def tokens(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            (output,) = engine.generate([prompt], GREEDY, use_tqdm=False)
            cache[tuple(prompt)] = output.outputs[0].token_ids
        return cache[tuple(prompt)]

    yield tokens
    engine.close()


@pytest.fixture
def one_at_a_time(checkpoint: Path) -> Iterator[Engine]:
    """One request runs at a time: the others wait outside the failing step."""
    with Engine(checkpoint, max_num_seqs=1, **KWARGS) as engine:
        yield engine


def _fail_execute(engine: Engine, on_calls: set[int], error: Callable[[], Exception]) -> list[int]:
    """Make the executor raise ``error()`` on the given calls (1-based); [calls so far]."""
    executor = engine._executor
    assert executor is not None
    real = executor.execute
    calls = [0]

    def execute(plan: Any) -> Any:
        calls[0] += 1
        if calls[0] in on_calls:
            raise error()
        return real(plan)

    executor.execute = execute  # type: ignore[method-assign]
    return calls


def _check_idle(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    engine.scheduler.pool.check_integrity()
    engine.scheduler.check_integrity()
    stats = engine.stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_waiting == stats.num_running == 0


def _drain(engine: Engine) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    for _ in range(200):
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finals, "a final output came twice"
                finals[output.request_id] = output
        if not engine.has_unfinished_requests():
            break
    return finals


def test_step_fails_its_requests_and_the_others_go_on(
    one_at_a_time: Engine, reference: Callable[[list[int]], list[int]]
) -> None:
    engine = one_at_a_time
    first = engine.add_request([1, 2, 3], GREEDY)
    second = engine.add_request([4, 5, 6], GREEDY)
    engine.step()
    _fail_execute(engine, {1}, lambda: Injected("injected sampler crash"))
    with pytest.raises(StepFailedError) as raised:
        engine.step()
    assert raised.value.request_ids == (first,)  # the waiting request had no row in it
    assert isinstance(raised.value.__cause__, Injected)
    finals = _drain(engine)
    assert sorted(finals, key=int) == [first, second]
    assert finals[first].outputs[0].finish_reason == "abort"
    assert len(finals[first].outputs[0].token_ids) == 1  # the first step's token only
    assert finals[second].outputs[0].token_ids == reference([4, 5, 6])
    _check_idle(engine)
    # The engine serves new requests as before.
    (output,) = engine.generate([[7, 8]], GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == reference([7, 8])


def test_generate_raises_for_its_own_failed_requests_only(
    one_at_a_time: Engine, reference: Callable[[list[int]], list[int]]
) -> None:
    engine = one_at_a_time
    queued = engine.add_request([1, 2, 3], GREEDY)  # runs first: the failing step is its
    _fail_execute(engine, {1}, lambda: Injected("injected"))
    # generate drives the failing step, which held only the other caller's request.
    (output,) = within(lambda: engine.generate([[4, 5, 6]], GREEDY, use_tqdm=False))
    assert output.outputs[0].token_ids == reference([4, 5, 6])
    with pytest.raises(StepFailedError) as raised:  # the owner of the failed request learns
        engine.step()
    assert raised.value.request_ids == (queued,)
    (final,) = engine.step()  # its final output, once
    assert final.request_id == queued and final.outputs[0].finish_reason == "abort"
    assert engine.step() == []
    # A generate whose requests are in the failing step raises it.
    _fail_execute(engine, {2}, lambda: Injected("again"))
    with pytest.raises(StepFailedError) as raised:
        engine.generate([[7, 8], [9, 10]], GREEDY, use_tqdm=False)
    assert len(raised.value.request_ids) == 1  # the one running; the other was aborted
    _check_idle(engine)


def test_a_stream_in_a_failed_step_raises(checkpoint: Path) -> None:
    with Engine(checkpoint, **KWARGS) as engine:
        stream = engine.stream([1, 2, 3], GREEDY)
        next(stream)
        _fail_execute(engine, {1}, lambda: Injected("injected"))
        with pytest.raises(StepFailedError) as raised:
            next(stream)
        assert raised.value.request_ids == (stream.request_id,)
        assert list(stream) == []  # ended
        _check_idle(engine)


def test_failed_steps_in_a_row_make_the_engine_dead(checkpoint: Path) -> None:
    with Engine(checkpoint, max_consecutive_failed_steps=2, **KWARGS) as engine:
        _fail_execute(engine, set(range(1, 100)), lambda: Injected("always"))
        with pytest.raises(StepFailedError):
            engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        waiting = engine.add_request([4, 5], GREEDY)
        stream = engine.stream([6, 7], GREEDY)
        with pytest.raises(EngineDeadError) as raised:
            engine.step()
        assert isinstance(raised.value.__cause__, Injected)
        assert "2 steps failed in a row" in str(raised.value)
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            next(stream)
        for call in (
            lambda: engine.generate([[1]], GREEDY, use_tqdm=False),
            lambda: engine.add_request([1], GREEDY),
            engine.step,
        ):
            with pytest.raises(EngineDeadError):
                call()
        assert not engine.abort(waiting)  # every request ended already
        _check_idle(engine)  # stats and has_unfinished_requests still answer


def test_a_success_resets_the_count_of_failed_steps(
    one_at_a_time: Engine, reference: Callable[[list[int]], list[int]]
) -> None:
    engine = one_at_a_time  # max_consecutive_failed_steps=3 (the default)
    # Two failed steps, a request run through (steps 3 to 10), two failed steps again.
    _fail_execute(engine, {1, 2, 11, 12}, lambda: Injected("now and then"))
    for prompt in ([1], [2]):
        with pytest.raises(StepFailedError):
            engine.generate([prompt], GREEDY, use_tqdm=False)
    (output,) = engine.generate([[4, 5]], GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == reference([4, 5])
    for prompt in ([3], [6]):
        with pytest.raises(StepFailedError):
            engine.generate([prompt], GREEDY, use_tqdm=False)
    assert not engine.is_dead
    _check_idle(engine)


@pytest.mark.parametrize(
    "error",
    [
        lambda: WorkerDiedError("injected: rank 1 exited"),
        lambda: RuntimeError("CUDA error: an illegal memory access was encountered"),
        lambda: torch.AcceleratorError("injected device error"),
    ],
    ids=["worker-died", "cuda-error", "accelerator-error"],
)
def test_a_fatal_failure_makes_the_engine_dead_at_once(
    checkpoint: Path, error: Callable[[], Exception]
) -> None:
    with Engine(checkpoint, **KWARGS) as engine:
        other = engine.stream([4, 5, 6], GREEDY)
        _fail_execute(engine, {1}, error)
        with pytest.raises(EngineDeadError) as raised:
            engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert type(raised.value.__cause__) is type(error())
        with pytest.raises(EngineDeadError):
            next(other)
        _check_idle(engine)


def test_fatal_failures() -> None:
    assert is_fatal(WorkerDiedError("x"), tensor_parallel=False)
    assert is_fatal(RuntimeError("CUDA error: device-side assert triggered"), tensor_parallel=False)
    assert is_fatal(ValueError("anything"), tensor_parallel=True)  # the ranks are out of step
    assert not is_fatal(RuntimeError("index 511 is out of bounds"), tensor_parallel=False)
    assert not is_fatal(torch.OutOfMemoryError("CUDA out of memory"), tensor_parallel=False)


# ------------------------------------------------------------------------- AsyncEngine
def _async_engine(checkpoint: Path) -> AsyncEngine:
    return AsyncEngine(checkpoint, **KWARGS)


async def _collect(stream: Any) -> list[RequestOutput]:
    return [output async for output in stream]


def test_async_engine_fails_the_streams_of_a_failed_step_logs_it_and_goes_on(
    checkpoint: Path,
    reference: Callable[[list[int]], list[int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = _async_engine(checkpoint)
    deaths: list[BaseException] = []
    engine.on_dead(deaths.append)
    _fail_execute(engine.engine, {3}, lambda: Injected("injected sampler crash"))

    async def main() -> None:
        streams = [engine.generate([i, i + 1, i + 2], GREEDY) for i in (1, 4)]
        results = await asyncio.gather(*map(_collect, streams), return_exceptions=True)
        for result in results:
            assert isinstance(result, StepFailedError), result
            assert isinstance(result.__cause__, Injected)
            assert "injected" not in str(result)  # no internals in what a client may see
        assert not engine.is_dead and engine.is_running
        # Later requests are served.
        outputs = await _collect(engine.generate([7, 8], GREEDY))
        assert outputs[-1].outputs[0].token_ids == reference([7, 8])

    try:
        with caplog.at_level(logging.ERROR, logger="pagedinfer"):
            asyncio.run(asyncio.wait_for(main(), 60))
        (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert record.name.startswith("pagedinfer") and record.exc_info is not None
        assert "injected sampler crash" in caplog.text  # the traceback, cause included
        assert not deaths
        within(lambda: _wait_idle(engine.engine))
    finally:
        engine.close()


def _wait_idle(engine: Engine) -> None:
    while engine.has_unfinished_requests() or engine.stats().kv_cache_usage:
        threading.Event().wait(0.01)
    engine.scheduler.pool.check_integrity()


def test_a_failed_forking_step_frees_every_completion(
    checkpoint: Path, reference: Callable[[list[int]], list[int]]
) -> None:
    """n > 1: the step that computes the prompt's last token forks the completions (blocks
    copied, slots taken); when it fails, the forks are undone and aborted with their parent."""
    with Engine(checkpoint, **KWARGS) as engine:
        params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4)
        # 19 tokens: one prefill step, and a partial last block for each fork to copy.
        _fail_execute(engine, {1}, lambda: Injected("at the fork"))
        with pytest.raises(StepFailedError) as raised:
            engine.generate([list(range(1, 20))], params, use_tqdm=False)
        assert raised.value.request_ids == ("0",)
        _check_idle(engine)
        assert not engine.scheduler.pending_block_copies
        (output,) = engine.generate([list(range(1, 20))], params, use_tqdm=False)
        assert [len(c.token_ids) for c in output.outputs] == [4, 4, 4]
        (greedy,) = engine.generate([[7, 8]], GREEDY, use_tqdm=False)
        assert greedy.outputs[0].token_ids == reference([7, 8])
        _check_idle(engine)
