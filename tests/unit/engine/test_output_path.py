"""One output path: every request ends once, with its final output delivered to its consumer.

Each test here hung (100 % CPU, forever) or lost an output before the output path was
rebuilt (issue 11); they run under a deadline (``bounded.within``) so a regression fails
instead of hanging the run.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedinfer import Engine, RequestOutput, SamplingParams
from pagedinfer.errors import EngineClosedError, InvalidRequestError

from .bounded import within

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture
def engine(checkpoint: Path) -> Iterator[Engine]:
    with Engine(
        checkpoint, device="cpu", kv_block_size=16, max_model_len=128, num_kv_blocks=64
    ) as engine:
        yield engine
        assert not engine.has_unfinished_requests()
        assert engine.stats().kv_cache_usage == 0.0


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Callable[[list[int], SamplingParams], list[int]]:
    """Greedy tokens of a prompt from an engine that runs nothing else."""
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=128) as engine:
        cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

        def tokens(prompt: list[int], params: SamplingParams) -> list[int]:
            key = (tuple(prompt), params.max_tokens)
            if key not in cache:
                (output,) = engine.generate([prompt], params, use_tqdm=False)
                cache[key] = output.outputs[0].token_ids
            return cache[key]

        yield tokens


def _tokens(deltas: list[RequestOutput]) -> list[int]:
    return [token for delta in deltas for token in delta.outputs[0].token_ids]


def _drain(engine: Engine) -> dict[str, RequestOutput]:
    """Step until idle; the final outputs step() returned, each checked to come once."""
    finals: dict[str, RequestOutput] = {}
    for _ in range(1000):
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finals, "a final output came twice"
                finals[output.request_id] = output
        if not engine.has_unfinished_requests():
            for output in engine.step():  # anything still waiting for step()
                assert output.finished and output.request_id not in finals
                finals[output.request_id] = output
            return finals
    raise AssertionError("the engine did not become idle")


@pytest.mark.parametrize("second_params", [GREEDY, LONG], ids=["same-length", "longer"])
def test_two_streams_consumed_alternately(
    engine: Engine, reference: Callable, second_params: SamplingParams
) -> None:
    """Both requests finish in the same step: each stream still gets its own final delta."""

    def body() -> tuple[list[RequestOutput], list[RequestOutput]]:
        first = engine.stream([1, 2, 3], GREEDY)
        second = engine.stream([4, 5, 6], second_params)
        pairs = list(zip(first, second, strict=False))  # ends with the shorter stream
        rest = list(second)
        return [a for a, _ in pairs], [b for _, b in pairs] + rest

    first, second = within(body)
    assert _tokens(first) == reference([1, 2, 3], GREEDY)
    assert _tokens(second) == reference([4, 5, 6], second_params)
    assert (
        first[-1].outputs[0].finish_reason == "length"
        and second[-1].outputs[0].finish_reason == "length"
    )
    assert [d.finished for d in second].count(True) == 1


def test_abort_inside_own_stream_loop_ends_with_an_abort_delta(engine: Engine) -> None:
    def body() -> list[RequestOutput]:
        deltas = []
        for delta in engine.stream([1, 2, 3], LONG):
            deltas.append(delta)
            if len(deltas) == 2:
                assert engine.abort(delta.request_id)
        return deltas

    deltas = within(body)
    assert len(deltas) == 3
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "abort"
    assert deltas[-1].outputs[0].token_ids == []  # nothing was generated after the abort
    assert not any(d.finished for d in deltas[:-1])


def test_generate_inside_a_stream_loop(engine: Engine, reference: Callable) -> None:
    """The streamed request finishes while generate() drives the engine."""

    def body() -> tuple[list[RequestOutput], list[list[int]]]:
        deltas, generated = [], []
        for delta in engine.stream([1, 2, 3], GREEDY):
            deltas.append(delta)
            if not generated:
                (output,) = engine.generate([[7, 8]], LONG, use_tqdm=False)
                generated.append(output.outputs[0].token_ids)
        return deltas, generated

    deltas, generated = within(body)
    assert _tokens(deltas) == reference([1, 2, 3], GREEDY)
    assert generated == [reference([7, 8], LONG)]
    assert len(deltas) == 2 and deltas[-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("driver", ["generate", "step"])
def test_a_stream_resumes_after_others_drove_the_engine(
    engine: Engine, reference: Callable, driver: str
) -> None:
    def body() -> list[RequestOutput]:
        stream = engine.stream([1, 2, 3], GREEDY)
        deltas = [next(stream)]
        if driver == "generate":  # long enough to finish the stream's request meanwhile
            engine.generate([[7, 8]], LONG, use_tqdm=False)
        else:
            for _ in range(20):
                assert engine.step() == []  # a streamed request's outputs go to its stream
        assert not engine.has_unfinished_requests()
        deltas.extend(stream)
        return deltas

    deltas = within(body)
    assert _tokens(deltas) == reference([1, 2, 3], GREEDY)
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
    assert len(deltas) == 2  # the rest came as one delta


def test_abort_output_reaches_step(engine: Engine) -> None:
    def body() -> dict[str, RequestOutput]:
        request_id = engine.add_request([1, 2, 3], LONG)
        engine.step()
        assert engine.abort(request_id)
        assert not engine.abort(request_id)
        return _drain(engine)

    finals = within(body)
    (output,) = finals.values()
    assert output.outputs[0].finish_reason == "abort" and len(output.outputs[0].token_ids) == 1


def test_abort_of_a_waiting_request_reaches_step(engine: Engine) -> None:
    request_id = engine.add_request([1, 2, 3], LONG)
    assert engine.abort(request_id)
    finals = within(lambda: _drain(engine))
    assert finals[request_id].outputs[0].finish_reason == "abort"
    assert finals[request_id].outputs[0].token_ids == []


def test_generate_returns_once_its_own_requests_are_done(
    engine: Engine, reference: Callable
) -> None:
    """Requests queued with add_request keep running; their outputs wait for step()."""

    def body() -> tuple[list[RequestOutput], dict[str, RequestOutput]]:
        long_id = engine.add_request([9, 9, 9], SamplingParams(temperature=0.0, max_tokens=100))
        outputs = engine.generate([[1, 2]], GREEDY, use_tqdm=False)
        assert engine.has_unfinished_requests()  # the long request is still running
        finals = _drain(engine)
        assert set(finals) == {long_id}
        return outputs, finals

    outputs, finals = within(body)
    assert outputs[0].outputs[0].token_ids == reference([1, 2], GREEDY)
    assert len(next(iter(finals.values())).outputs[0].token_ids) == 100


def test_step_outputs_are_the_latest_state_of_each_request(engine: Engine) -> None:
    """Steps driven by generate() do not pile up outputs for step(): one per request."""
    request_id = engine.add_request([9, 9, 9], LONG)
    within(lambda: engine.generate([[1, 2]], GREEDY, use_tqdm=False))
    (output,) = engine.step()
    assert output.request_id == request_id and not output.finished
    assert len(output.outputs[0].token_ids) == GREEDY.max_tokens + 1
    within(lambda: _drain(engine))


def test_a_dropped_stream_is_aborted(engine: Engine) -> None:
    def body() -> None:
        for _delta in engine.stream([1, 2, 3], LONG):
            break  # the stream is garbage now
        gc.collect()
        assert not engine.has_unfinished_requests()

    within(body)


def test_a_stream_closed_early_is_aborted(engine: Engine) -> None:
    stream = engine.stream([1, 2, 3], LONG)
    next(stream)
    stream.close()
    stream.close()
    assert list(stream) == []
    assert not engine.has_unfinished_requests()


def test_a_stream_is_queued_and_validated_when_created(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        engine.stream([])
    stream = engine.stream([1, 2, 3], GREEDY)
    assert engine.has_unfinished_requests()
    deltas = within(lambda: list(stream))
    assert deltas[0].request_id == stream.request_id
    assert deltas[-1].finished


def test_closing_the_engine_ends_open_streams_with_abort(checkpoint: Path) -> None:
    engine = Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=128)
    stream = engine.stream([1, 2, 3], LONG)
    next(stream)
    request_id = engine.add_request([4, 5, 6], LONG)
    engine.close()
    (last,) = list(stream)
    assert last.finished and last.outputs[0].finish_reason == "abort"
    with pytest.raises(EngineClosedError, match="the engine is closed"):
        engine.step()
    with pytest.raises(EngineClosedError, match="the engine is closed"):
        engine.abort(request_id)


def test_nothing_to_run_raises_instead_of_spinning(engine: Engine) -> None:
    """A consumer waits for a request the scheduler no longer has: an error, not a hang."""
    stream = engine.stream([1, 2, 3], LONG)
    next(stream)
    engine.scheduler.abort(int(stream.request_id))  # behind the engine's back (a bug elsewhere)

    def body() -> None:
        with pytest.raises(RuntimeError, match="nothing left to run"):
            next(stream)

    within(body, seconds=20)
    engine.abort(stream.request_id)  # the engine's record goes; nothing else is held
