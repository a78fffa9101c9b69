"""AsyncEngine: outputs as tokens arrive, batching across coroutines, cancellation, abort,
a failing step, close."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import AsyncEngine, Engine, RequestOutput, SamplingParams
from pagedinfer.errors import (
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    WorkerDiedError,
)

ENGINE_KWARGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "num_kv_blocks": 256,
    "max_model_len": 1024,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def shared(checkpoint: Path) -> Iterator[AsyncEngine]:
    """One engine for the tests that leave it healthy (each test runs its own event loop)."""
    engine = AsyncEngine(checkpoint, **ENGINE_KWARGS)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def offline(checkpoint: Path) -> Iterator[Engine]:
    with Engine(checkpoint, **ENGINE_KWARGS) as engine:
        yield engine


def _run(coroutine: Any, timeout: float = 120) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


async def _last(stream: Any) -> RequestOutput:
    outputs = [output async for output in stream]
    assert outputs
    final: RequestOutput = outputs[-1]
    return final


def _idle(engine: AsyncEngine) -> bool:
    stats = engine.engine.stats()
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0


def _wait_idle(engine: AsyncEngine, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not _idle(engine):
        assert time.monotonic() < deadline, engine.engine.stats()
        time.sleep(0.01)


def test_outputs_arrive_as_tokens_do_and_are_cumulative(
    shared: AsyncEngine, offline: Engine
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["zz"])
    (want,) = offline.generate(["Hello, world!"], params, use_tqdm=False)

    async def main() -> list[RequestOutput]:
        return [output async for output in shared.generate("Hello, world!", params)]

    outputs = _run(main())
    assert len(outputs) > 1  # streamed: more than the final output
    for before, after in itertools.pairwise(outputs):
        assert (
            after.outputs[0].token_ids[: len(before.outputs[0].token_ids)]
            == before.outputs[0].token_ids
        )
        assert after.outputs[0].text.startswith(before.outputs[0].text)  # text only grows
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    final = outputs[-1]
    assert (final.outputs[0].token_ids, final.outputs[0].text, final.outputs[0].finish_reason) == (
        want.outputs[0].token_ids,
        want.outputs[0].text,
        want.outputs[0].finish_reason,
    )


def test_n_completions_stream_cumulatively_each_on_its_own(
    shared: AsyncEngine, offline: Engine
) -> None:
    """n=3, seeded, one completion cut short by a stop string: every output holds the three
    completions so far, each only grows, one that finished keeps its finish reason while
    the others run on, and the final output equals Engine.generate's."""
    free = SamplingParams(n=3, seed=4, max_tokens=20, ignore_eos=True, logprobs=1)
    (unstopped,) = offline.generate(["three ways"], free, use_tqdm=False)
    texts = [completion.text for completion in unstopped.outputs]
    stop = next(
        texts[0][i : i + 2]
        for i in range(len(texts[0]) // 3, len(texts[0]) - 2)
        if texts[0][i : i + 2].strip() and all(texts[0][i : i + 2] not in t for t in texts[1:])
    )
    params = dataclasses.replace(free, stop=(stop,))
    (want,) = offline.generate(["three ways"], params, use_tqdm=False)

    async def main() -> list[RequestOutput]:
        return [output async for output in shared.generate("three ways", params)]

    outputs = _run(main())
    assert len(outputs) > 2
    assert all([c.index for c in output.outputs] == [0, 1, 2] for output in outputs)
    for index in range(3):
        seen = [output.outputs[index] for output in outputs]
        for before, after in itertools.pairwise(seen):
            assert after.token_ids[: len(before.token_ids)] == before.token_ids
            assert after.text.startswith(before.text)
            assert after.logprobs is not None and before.logprobs is not None
            assert after.logprobs[: len(before.logprobs)] == before.logprobs
            if before.finish_reason is not None:
                assert after == before  # a finished completion no longer changes
    final = outputs[-1]
    assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in final.outputs] == [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in want.outputs
    ]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert final.outputs[1].finish_reason == "length"
    # The stopped completion finished while the others still ran.
    assert any(
        o.outputs[0].finish_reason == "stop" and o.outputs[1].finish_reason is None for o in outputs
    )


def test_cancelling_an_n_request_aborts_every_completion(shared: AsyncEngine) -> None:
    params = SamplingParams(n=3, seed=1, max_tokens=1000, ignore_eos=True)

    async def main() -> RequestOutput:
        first = asyncio.Event()
        seen: list[RequestOutput] = []

        async def consume() -> None:
            async for output in shared.generate("cancel all three", params):
                seen.append(output)
                if all(c.token_ids for c in output.outputs):
                    first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        assert shared.engine.stats().num_running == 3
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen[-1]

    before = shared.engine.stats()
    last = _run(main())
    assert len(last.outputs) == 3
    _wait_idle(shared)  # nothing running, every KV block free
    after = shared.engine.stats()
    assert after.num_requests_finished == before.num_requests_finished + 1
    assert after.num_generated_tokens - before.num_generated_tokens < 3 * 1000
    assert not shared._ids and not shared._streams


def test_many_coroutines_batch_together(
    shared: AsyncEngine, offline: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [f"prompt number {i}" for i in range(16)]
    expected = offline.generate(prompts, GREEDY, use_tqdm=False)
    batch_sizes: list[int] = []
    link = shared._link
    step = link.step

    def counting_step() -> list[RequestOutput]:
        batch_sizes.append(shared.engine.stats().num_running)
        return step()

    monkeypatch.setattr(link, "step", counting_step)

    async def main() -> list[RequestOutput]:
        return await asyncio.gather(*(_last(shared.generate(p, GREEDY)) for p in prompts))

    outputs = _run(main())
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in expected]
    assert max(batch_sizes) >= 12, batch_sizes  # one batch, not one request after another
    assert len(batch_sizes) < 16 * 16


def test_cancelling_the_consumer_aborts_its_request(shared: AsyncEngine) -> None:
    async def main() -> None:
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in shared.generate("cancel me", LONG, request_id="to-cancel"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    before = shared.engine.stats()
    _run(main())
    _wait_idle(shared)
    after = shared.engine.stats()
    assert after.num_requests_finished == before.num_requests_finished + 1
    assert after.num_generated_tokens - before.num_generated_tokens < LONG.max_tokens  # type: ignore[operator]
    assert not shared._ids and not shared._streams  # the id may be used again


def test_leaving_the_loop_early_aborts(shared: AsyncEngine) -> None:
    async def main() -> None:
        stream = shared.generate("break out", LONG)
        async for _ in stream:
            break
        del stream
        gc.collect()

    before = shared.engine.stats()
    _run(main())
    _wait_idle(shared)
    after = shared.engine.stats()
    assert after.num_generated_tokens - before.num_generated_tokens < LONG.max_tokens  # type: ignore[operator]
    assert not shared._ids


def test_abort_from_another_coroutine_ends_the_stream(shared: AsyncEngine) -> None:
    async def main() -> RequestOutput:
        stream = shared.generate("abort me", LONG, request_id="victim")
        first = await anext(stream)
        assert not first.finished
        assert await shared.abort("victim")
        final = await _last(stream)
        assert not await shared.abort("victim")  # finished: unknown now
        assert not await shared.abort("never-existed")
        return final

    final = _run(main())
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert 0 < len(final.outputs[0].token_ids) < LONG.max_tokens  # type: ignore[operator]
    _wait_idle(shared)


def test_outputs_carry_the_streams_request_id(shared: AsyncEngine) -> None:
    """vLLM's AsyncLLM: every output names the request as the caller did (a string)."""

    async def main() -> tuple[list[str], list[str], str]:
        named = shared.generate("x", GREEDY, request_id="mine")
        fresh = shared.generate("y", GREEDY)
        return (
            [output.request_id async for output in named],
            [output.request_id async for output in fresh],
            fresh.request_id,
        )

    named, fresh, fresh_id = _run(main())
    assert named and set(named) == {"mine"}
    assert fresh and set(fresh) == {fresh_id} and isinstance(fresh_id, str)


def test_bad_input_raises_at_the_call_and_the_engine_keeps_serving(shared: AsyncEngine) -> None:
    async def main() -> RequestOutput:
        with pytest.raises(InvalidRequestError, match="the prompt is empty"):
            shared.generate("", GREEDY)
        with pytest.raises(InvalidRequestError, match="token id 1000000 is out of vocabulary"):
            shared.generate([1, 10**6], GREEDY)
        with pytest.raises(InvalidRequestError, match=r"prompt has 2000 tokens.*max_model_len"):
            shared.generate([1] * 2000, GREEDY)
        stream = shared.generate("x", GREEDY, request_id="dup")
        with pytest.raises(InvalidRequestError, match="already in use"):
            shared.generate("y", GREEDY, request_id="dup")
        return await _last(stream)

    assert _run(main()).outputs[0].finish_reason == "length"


def test_chat_equals_generate_on_the_templates_tokens(shared: AsyncEngine, offline: Engine) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    text = offline.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    (want,) = offline.generate(
        [offline.tokenizer.encode(text, add_special_tokens=False)], GREEDY, use_tqdm=False
    )

    async def main() -> RequestOutput:
        return await _last(shared.chat(messages, GREEDY))

    got = _run(main())
    assert (got.prompt_token_ids, got.outputs[0].token_ids) == (
        want.prompt_token_ids,
        want.outputs[0].token_ids,
    )


def test_stats(shared: AsyncEngine) -> None:
    stats = _run(shared.stats())
    assert stats.num_kv_blocks == ENGINE_KWARGS["num_kv_blocks"]


def test_a_fatal_step_failure_raises_in_every_consumer_and_the_engine_is_dead(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fatal failure (a tensor-parallel worker gone): every stream raises EngineDeadError,
    later requests too, the traceback is logged and on_dead callbacks run once, from the
    step thread (ordinary failures: test_step_failures.py)."""
    engine = AsyncEngine(checkpoint, **ENGINE_KWARGS)
    executor = engine.engine._executor
    assert executor is not None
    execute = executor.execute
    calls = 0
    deaths: list[tuple[BaseException, str]] = []
    called = threading.Event()

    def on_dead(error: BaseException) -> None:
        deaths.append((error, threading.current_thread().name))
        called.set()

    engine.on_dead(on_dead)

    def failing_execute(plan: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 4:
            raise WorkerDiedError("injected worker death")
        return execute(plan)

    executor.execute = failing_execute  # type: ignore[method-assign]

    async def main() -> list[BaseException]:
        streams = [engine.generate(f"consumer {i}", LONG) for i in range(4)]
        results = await asyncio.gather(*(_last(s) for s in streams), return_exceptions=True)
        assert engine.is_dead and not engine.is_running
        with pytest.raises(EngineDeadError):
            engine.generate("after death", GREEDY)
        return [r for r in results if isinstance(r, BaseException)]

    try:
        with caplog.at_level(logging.ERROR, logger="pagedinfer"):
            errors = _run(main())
        assert len(errors) == 4
        for error in errors:
            assert isinstance(error, EngineDeadError)
            assert isinstance(error.__cause__, EngineDeadError)  # the Engine's
            assert isinstance(error.__cause__.__cause__, WorkerDiedError)
            assert "injected worker death" in str(error)
        assert called.wait(30)  # after the streams were failed
        ((dead_error, thread),) = deaths
        assert dead_error is engine.dead_error and thread == "pagedinfer-step-loop"
        late: list[BaseException] = []
        engine.on_dead(late.append)  # already dead: called at once
        assert late == [engine.dead_error]
        (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert record.exc_info is not None and "injected worker death" in caplog.text
        assert engine.engine.stats().kv_cache_usage == 0.0  # every request was aborted
    finally:
        engine.close()


def test_close_ends_streams_with_abort_and_refuses_new_requests(checkpoint: Path) -> None:
    async def main() -> RequestOutput:
        async with AsyncEngine(checkpoint, **ENGINE_KWARGS) as engine:
            stream = engine.generate("closing", LONG)
            await anext(stream)
            await asyncio.to_thread(engine.close)
            final = await _last(stream)
            with pytest.raises(EngineClosedError, match="AsyncEngine is closed"):
                engine.generate("after close", GREEDY)
            with pytest.raises(EngineClosedError, match="AsyncEngine is closed"):
                await engine.stats()
            return final

    final = _run(main())
    assert final.finished and final.outputs[0].finish_reason == "abort"


def test_from_engine_wraps_an_existing_engine(checkpoint: Path) -> None:
    engine = Engine(checkpoint, **ENGINE_KWARGS)

    async def main() -> RequestOutput:
        async with AsyncEngine.from_engine(engine) as wrapped:
            assert wrapped.engine is engine
            return await _last(wrapped.generate("wrapped", GREEDY))

    assert _run(main()).outputs[0].finish_reason == "length"
    with pytest.raises(EngineClosedError, match="engine is closed"):
        engine.stats()


def test_add_request_stream_true_carries_text_while_running(offline: Engine) -> None:
    """What AsyncEngine builds on: step() outputs of a streamed request carry its text."""
    plain = offline.add_request("Hello, world!", GREEDY)
    streamed = offline.add_request("Hello, world!", GREEDY, stream=True)
    texts: dict[str, list[str]] = {plain: [], streamed: []}
    finals: dict[str, RequestOutput] = {}
    while len(finals) < 2:
        for output in offline.step():
            if output.finished:
                finals[output.request_id] = output
            else:
                texts[output.request_id].append(output.outputs[0].text)
    assert finals[plain].outputs[0].text == finals[streamed].outputs[0].text
    assert all(text == "" for text in texts[plain])  # decoded once, at the end
    assert texts[streamed][-1] and finals[streamed].outputs[0].text.startswith(texts[streamed][-1])


def test_speculative_config_reaches_the_engine(checkpoint: Path, offline: Engine) -> None:
    """``AsyncEngine(..., speculative_config=...)`` is the Engine's argument: n-gram drafts
    are accepted, and the streamed greedy and seeded completions are the offline engine's
    without speculation."""
    prompts = ["hello hello hello", "the cat"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=32, ignore_eos=True),
    ]
    expected = offline.generate(prompts, params, use_tqdm=False)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    engine = AsyncEngine(checkpoint, speculative_config=ngram, **ENGINE_KWARGS)

    async def generate(prompt: str, p: SamplingParams) -> list[RequestOutput]:
        return [output async for output in engine.generate(prompt, p)]

    async def main() -> list[list[RequestOutput]]:
        return list(await asyncio.gather(*map(generate, prompts, params)))

    try:
        streams = _run(main())
        stats = _run(engine.stats())
    finally:
        engine.close()
    for outputs, want in zip(streams, expected, strict=True):
        assert outputs[-1].finished
        assert outputs[-1].outputs[0].token_ids == want.outputs[0].token_ids
        assert outputs[-1].outputs[0].text == want.outputs[0].text
    assert stats.spec_decode_num_accepted_tokens > 0, "no draft was accepted: a weak test"
