"""The thread model: any method from any thread; steps serialized, outputs routed per request.

Before issue 11, two threads calling ``generate()`` raised an internal ``BlockPoolError``
(prefix caching on) or spun forever (off), and ``abort()`` from a second thread left the
waiting ``generate()`` spinning. Every body runs under a deadline (``bounded.within``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedinfer import Engine, RequestOutput, SamplingParams
from pagedinfer.errors import EngineClosedError

from .bounded import within

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3] * 7, [1, 2, 3] * 7 + [4], [5, 6], [7, 8, 9, 10], [11] * 20, [12, 13]]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


def _engine(checkpoint: Path, **overrides: object) -> Engine:
    options: dict[str, object] = {
        "device": "cpu",
        "kv_block_size": 16,
        "max_model_len": 128,
        "num_kv_blocks": 32,
    }
    options.update(overrides)
    return Engine(checkpoint, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> dict[tuple[int, ...], list[int]]:
    with _engine(checkpoint) as engine:
        outputs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, outputs, strict=True)}


def _run_threads(*bodies: Callable[[], None]) -> None:
    errors: list[BaseException] = []

    def guarded(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException as error:
                errors.append(error)

        return run

    threads = [threading.Thread(target=guarded(body), daemon=True) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_concurrent_generate_calls_are_each_correct(
    checkpoint: Path, reference: dict[tuple[int, ...], list[int]], prefix_caching: bool
) -> None:
    with _engine(checkpoint, enable_prefix_caching=prefix_caching) as engine:

        def worker(offset: int) -> Callable[[], None]:
            def body() -> None:
                for round_ in range(4):
                    batch = [PROMPTS[(offset + round_ + i) % len(PROMPTS)] for i in range(3)]
                    outputs = engine.generate(batch, GREEDY, use_tqdm=False)
                    for prompt, output in zip(batch, outputs, strict=True):
                        assert output.prompt_token_ids == prompt
                        assert output.outputs[0].token_ids == reference[tuple(prompt)]

            return body

        within(lambda: _run_threads(worker(0), worker(2), worker(4)))
        assert not engine.has_unfinished_requests()
        assert engine.stats().kv_cache_usage == 0.0
        # Correct service afterwards.
        (output,) = engine.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
        assert output.outputs[0].token_ids == reference[tuple(PROMPTS[0])]


def test_abort_from_another_thread_ends_the_waiting_generate(checkpoint: Path) -> None:
    with _engine(checkpoint) as engine:
        long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)

        def killer() -> None:
            while engine.stats().num_generated_tokens < 5:
                time.sleep(0.001)
            assert engine.abort("0")  # the first request of a fresh engine

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        (output,) = within(lambda: engine.generate([[1, 2, 3]], long, use_tqdm=False))
        thread.join()
        assert output.finished and output.outputs[0].finish_reason == "abort"
        assert 5 <= len(output.outputs[0].token_ids) < 120
        assert engine.stats().kv_cache_usage == 0.0


def test_abort_from_another_thread_ends_a_stream(checkpoint: Path) -> None:
    with _engine(checkpoint) as engine:
        long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        stream = engine.stream([1, 2, 3], long)
        first = next(stream)
        aborter = threading.Thread(target=lambda: engine.abort(stream.request_id))
        aborter.start()
        aborter.join()
        deltas = [first, *within(lambda: list(stream))]
        assert deltas[-1].outputs[0].finish_reason == "abort"
        assert sum(len(d.outputs[0].token_ids) for d in deltas) < 120


def test_a_background_stepper_serves_requests_from_other_threads(
    checkpoint: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    """What AsyncEngine does: one thread calls step(), others add and abort requests."""
    with _engine(checkpoint) as engine:
        finals: dict[int, list[RequestOutput]] = {}
        waiting: dict[int, queue.Queue[RequestOutput]] = {}
        routes = threading.Lock()
        stop = threading.Event()

        def stepper() -> None:
            while not stop.is_set():
                outputs = engine.step()
                for output in outputs:
                    if output.finished:
                        with routes:
                            finals.setdefault(output.request_id, []).append(output)
                            waiting[output.request_id].put(output)
                if not outputs:
                    time.sleep(0.0005)

        def client(offset: int, abort_some: bool) -> Callable[[], None]:
            def body() -> None:
                for i in range(6):
                    prompt = PROMPTS[(offset + i) % len(PROMPTS)]
                    with routes:  # registered before the stepper can finish it
                        request_id = engine.add_request(prompt, GREEDY)
                        waiting[request_id] = queue.Queue()
                    if abort_some and i % 2:
                        engine.abort(request_id)
                    output = waiting[request_id].get(timeout=30)
                    if abort_some and i % 2:
                        assert output.outputs[0].finish_reason in ("abort", "length")
                    else:
                        assert output.outputs[0].finish_reason == "length"
                    if output.outputs[0].finish_reason == "length":
                        assert output.outputs[0].token_ids == reference[tuple(prompt)]

            return body

        loop = threading.Thread(target=stepper, daemon=True)
        loop.start()
        try:
            within(lambda: _run_threads(client(0, False), client(1, True), client(3, True)))
        finally:
            stop.set()
            loop.join(10)
        assert not loop.is_alive()
        assert len(finals) == 18
        assert all(len(outputs) == 1 for outputs in finals.values())  # exactly once
        assert not engine.has_unfinished_requests()
        assert engine.stats().kv_cache_usage == 0.0


def test_streams_and_generate_in_different_threads(
    checkpoint: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    with _engine(checkpoint) as engine:
        streamed: list[list[RequestOutput]] = []

        def streamer() -> None:
            for prompt in PROMPTS[:3]:
                streamed.append(list(engine.stream(prompt, GREEDY)))

        def generator() -> None:
            for _ in range(3):
                outputs = engine.generate(PROMPTS[3:], GREEDY, use_tqdm=False)
                assert [o.outputs[0].token_ids for o in outputs] == [
                    reference[tuple(p)] for p in PROMPTS[3:]
                ]

        within(lambda: _run_threads(streamer, generator))
        for prompt, deltas in zip(PROMPTS[:3], streamed, strict=True):
            assert [t for d in deltas for t in d.outputs[0].token_ids] == reference[tuple(prompt)]
            assert deltas[-1].outputs[0].finish_reason == "length"


def test_close_from_another_thread_ends_a_waiting_generate(checkpoint: Path) -> None:
    engine = _engine(checkpoint)
    long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    results: list[object] = []

    def generate() -> None:
        try:
            results.append(engine.generate([[1, 2, 3], [4, 5]], long, use_tqdm=False))
        except EngineClosedError as error:
            results.append(error)

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    while engine.stats().num_generated_tokens < 4:
        time.sleep(0.001)
    engine.close()
    thread.join(30)
    assert not thread.is_alive()
    (result,) = results
    if isinstance(result, list):  # the step it was running ended first
        assert all(output.outputs[0].finish_reason == "abort" for output in result)
    else:
        assert isinstance(result, EngineClosedError)


@pytest.fixture
def idle_engine(checkpoint: Path) -> Iterator[Engine]:
    with _engine(checkpoint) as engine:
        yield engine


def test_add_request_does_not_wait_for_a_running_step(idle_engine: Engine) -> None:
    """The lock is released while the model runs: other threads queue and abort meanwhile."""
    engine = idle_engine
    executor = engine._executor
    assert executor is not None
    entered, release = threading.Event(), threading.Event()
    real_execute = executor.execute

    def slow_execute(plan: object) -> list[int]:
        entered.set()
        release.wait(30)
        return real_execute(plan)  # type: ignore[arg-type]

    executor.execute = slow_execute  # type: ignore[method-assign]
    first = engine.add_request([1, 2, 3], GREEDY)
    returned: list[RequestOutput] = []
    stepping = threading.Thread(target=lambda: returned.extend(engine.step()), daemon=True)
    stepping.start()
    assert entered.wait(30)
    second = within(lambda: engine.add_request([4, 5, 6], GREEDY), seconds=5)
    assert within(lambda: engine.abort(first), seconds=5)
    release.set()
    stepping.join(30)
    executor.execute = real_execute  # type: ignore[method-assign]
    # The abort came while that step ran: the step() call returned its final output.
    (aborted,) = returned
    assert aborted.request_id == first and aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].token_ids == []
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert (
        list(finals) == [second] and len(finals[second].outputs[0].token_ids) == GREEDY.max_tokens
    )


def test_step_keeps_pace_with_threads_that_keep_calling_generate(
    checkpoint: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    """Issue 21, item 6: a step() caller waited for a moment when no step was running, which
    never came while other threads kept calling generate() (it returned only after they
    stopped). A step() that waits now counts the step it waited for as its own."""
    with _engine(checkpoint) as engine:
        stop = threading.Event()
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

        def generating(prompt: list[int]) -> Callable[[], None]:
            def body() -> None:
                while not stop.is_set():
                    engine.generate([prompt], long, use_tqdm=False)

            return body

        def stepping() -> RequestOutput:
            request_id = engine.add_request(PROMPTS[2], GREEDY)
            while True:
                for output in engine.step():
                    if output.finished and output.request_id == request_id:
                        return output

        threads = [
            threading.Thread(target=generating(prompt), daemon=True)
            for prompt in (PROMPTS[0], PROMPTS[3])
        ]
        for thread in threads:
            thread.start()
        try:
            while engine.stats().num_running < 2:  # both generate calls are stepping
                time.sleep(0.001)
            started = time.perf_counter()
            final = within(stepping, seconds=15)
            elapsed = time.perf_counter() - started
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
        assert final.outputs[0].token_ids == reference[tuple(PROMPTS[2])]
        assert elapsed < 15
        assert not engine.has_unfinished_requests()
        assert engine.stats().kv_cache_usage == 0.0


def test_a_prompt_is_tokenized_without_the_engine_lock(
    idle_engine: Engine, reference: dict[tuple[int, ...], list[int]]
) -> None:
    """Issue 21, item 3: add_request tokenized under the engine's lock, so one long prompt
    stalled every other thread. Here the tokenizer blocks until released: generate() from
    another thread must finish meanwhile."""
    engine = idle_engine
    tokenizer = engine.tokenizer
    entered, release = threading.Event(), threading.Event()
    real_encode = tokenizer.encode

    def blocking_encode(text: str, **kwargs: object) -> list[int]:
        entered.set()
        release.wait(30)
        return list(real_encode(text, **kwargs))

    tokenizer.encode = blocking_encode
    added: list[int] = []
    adding = threading.Thread(target=lambda: added.append(engine.add_request("hello")))
    adding.start()
    try:
        assert entered.wait(30)
        (output,) = within(lambda: engine.generate([PROMPTS[2]], GREEDY, use_tqdm=False), 10)
        assert output.outputs[0].token_ids == reference[tuple(PROMPTS[2])]
        assert engine.stats().num_requests_finished == 1  # and stats did not wait either
    finally:
        release.set()
        adding.join(30)
        del tokenizer.encode  # the class's method again
    assert len(added) == 1
    engine.abort(added[0])


def test_tokenizing_megabytes_of_text_does_not_stall_other_threads(idle_engine: Engine) -> None:
    """The real tokenizer on a long text (over a second on one core) in add_request: the
    fast tokenizer releases the GIL and the engine holds no lock meanwhile, so a generate()
    in another thread ends first."""
    engine = idle_engine
    text = "The quick brown fox jumps over the lazy dog. " * 30_000  # 1.35 MB
    finished = threading.Event()
    raised: list[BaseException] = []

    def tokenize() -> None:
        try:
            engine.add_request(text)
        except BaseException as error:
            raised.append(error)
        finished.set()

    thread = threading.Thread(target=tokenize, daemon=True)
    thread.start()
    time.sleep(0.05)  # the tokenizer is at work
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    within(lambda: engine.generate([[1, 2, 3]], short, use_tqdm=False), 30)
    assert not finished.is_set(), "the generate call waited for the tokenizer"
    thread.join(60)
    (error,) = raised  # far longer than max_model_len, once tokenized
    assert "max_model_len=128" in str(error)
