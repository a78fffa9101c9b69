"""Sleep/wake and pause/resume on the CPU (issue 40; docs/sleep_mode.md)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedinfer import AsyncEngine, Engine, SamplingParams
from pagedinfer.errors import (
    ConfigurationError,
    EnginePausedError,
    EngineSleepingError,
    EngineStateError,
)

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
# 2 layers x 2 kv heads x head_dim 32 x 16 tokens x K/V x 4 bytes = 16 KiB a block: 48 MiB.
NUM_BLOCKS = 3072


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Iterator[Engine]:
    with Engine(
        tiny_checkpoint,
        device="cpu",
        dtype="float32",
        kv_block_size=16,
        max_model_len=64,
        num_kv_blocks=NUM_BLOCKS,
    ) as built:
        yield built


@pytest.fixture(scope="module")
def expected(engine: Engine) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in engine.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _generate(engine: Engine) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in engine.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_kv_cache_and_wake_up_restores_the_outputs(
    engine: Engine, expected: list[list[int]], level: int
) -> None:
    runner = engine._executor
    cache = weakref.ref(runner.kv_cache)  # type: ignore[union-attr]
    model = weakref.ref(runner.model)  # type: ignore[union-attr]
    engine.sleep(level=level)  # level 2 runs the cycle collector for the model
    assert engine.is_sleeping()
    # The KV tensor and its storage are gone. (Whether the process's RSS falls too depends on
    # the allocator's history: alone it falls by the cache's 48 MiB; late in the whole suite
    # glibc kept the pages once, so RSS is not asserted here.)
    assert cache() is None
    assert (model() is None) == (level == 2)  # level 2 drops the weights too
    with pytest.raises(EngineSleepingError, match="wake_up"):
        engine.generate(PROMPTS, PARAMS, use_tqdm=False)
    with pytest.raises(EngineSleepingError):
        engine.add_request([1, 2, 3], PARAMS)
    assert engine.step() == []  # nothing runs, nothing hangs
    engine.wake_up()
    assert not engine.is_sleeping()
    assert _generate(engine) == expected


def test_wake_up_by_tags_weights_first(engine: Engine, expected: list[list[int]]) -> None:
    engine.sleep(level=2)
    engine.wake_up(tags=["weights"])
    assert engine.is_sleeping()  # the KV cache still sleeps
    with pytest.raises(EngineSleepingError):
        engine.add_request([1, 2, 3], PARAMS)
    engine.wake_up(tags=["kv_cache"])
    assert not engine.is_sleeping()
    assert _generate(engine) == expected
    engine.wake_up()  # awake already: nothing happens


def test_bad_levels_tags_and_a_busy_engine_are_refused(engine: Engine) -> None:
    with pytest.raises(ConfigurationError, match="sleep level 3"):
        engine.sleep(level=3)
    with pytest.raises(ConfigurationError, match="tags"):
        engine.wake_up(tags=["optimizer"])
    request = engine.add_request([1, 2, 3], PARAMS)
    with pytest.raises(EngineStateError, match="1 request"):
        engine.sleep()
    assert not engine.is_sleeping()
    engine.abort(request)
    engine.step()


def test_pause_keeps_requests_queued_and_resume_finishes_them(
    engine: Engine, expected: list[list[int]]
) -> None:
    engine.pause_generation()
    assert engine.is_paused()
    results: list[list[list[int]]] = []
    worker = threading.Thread(target=lambda: results.append(_generate(engine)))
    worker.start()
    time.sleep(0.3)
    assert not results and engine.has_unfinished_requests()  # queued, not failed
    assert engine.step() == []  # no step runs while paused
    with pytest.raises(EnginePausedError, match="resume_generation"):
        engine.generate([[1, 2]], PARAMS, use_tqdm=False)  # would wait for itself
    engine.resume_generation()
    worker.join(timeout=30)
    assert results == [expected]


def test_pause_between_steps_of_a_running_generate(
    engine: Engine, expected: list[list[int]]
) -> None:
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results: list[int] = []
    worker = threading.Thread(
        target=lambda: results.append(
            len(engine.generate([[3, 4, 5]], long, use_tqdm=False)[0].outputs[0].token_ids)
        )
    )
    worker.start()
    while not engine.has_unfinished_requests():
        time.sleep(0.001)
    engine.pause_generation(timeout=10)
    done = engine.stats().num_generated_tokens
    time.sleep(0.2)
    assert engine.stats().num_generated_tokens == done  # no step ran while paused
    engine.resume_generation()
    worker.join(timeout=30)
    assert results == [40]


def test_async_engine_sleep_and_pause(tiny_checkpoint: Path) -> None:
    import asyncio

    async def main() -> None:
        async with AsyncEngine(
            tiny_checkpoint, device="cpu", dtype="float32", kv_block_size=16, max_model_len=64
        ) as engine:
            await engine.sleep(level=1)
            assert engine.is_sleeping()
            with pytest.raises(EngineSleepingError):
                engine.generate([1, 2, 3], PARAMS)
            await engine.wake_up()
            await engine.pause_generation()
            stream = engine.generate([1, 2, 3], PARAMS)
            waiter = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.2)
            assert not waiter.done()  # queued while paused
            await engine.resume_generation()
            final = None
            first = await waiter
            final = first
            async for output in stream:
                final = output
            assert final is not None and len(final.outputs[0].token_ids) == 6

    asyncio.run(main())


def test_llm_accepts_enable_sleep_mode(make_checkpoint: Callable[..., Path]) -> None:
    from pagedinfer import LLM

    llm = LLM(
        str(make_checkpoint("tiny")),
        enable_sleep_mode=True,
        device="cpu",
        kv_block_size=16,
        max_model_len=64,
    )
    try:
        llm.sleep(level=1)
        assert llm.is_sleeping()
        llm.wake_up()
        assert len(llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == 6
    finally:
        llm.close()
