"""An exception or Ctrl-C at any stage of a step leaves the engine consistent.

Each case injects one failure into one stage of one step (before or after the stage's real
work), as a ``RuntimeError``, a ``KeyboardInterrupt`` raised in place, or a real SIGINT
delivered to the process at that point; then the engine is driven to the end. Every request
must end exactly once with greedy tokens equal to an undisturbed run, nothing may stay
orphaned (``has_unfinished_requests()`` turned into an endless ``[]`` before issue 11), and
the block pool must be all free.

An ordinary exception raised by the executor is a failed step, whose requests fail
(``StepFailedError``): that policy is tested in ``test_step_failures.py``; here the executor
only sees interrupts.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import Engine, RequestOutput, SamplingParams
from pagedinfer.domain.structured import StructuredOutputsParams
from pagedinfer.engine.requests import RequestState

from .bounded import within

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
STEP_PROMPTS = [[1, 2, 3, 4] * 5, [5, 6, 7]]
STREAM_PROMPT = [8, 9, 10, 11, 12]
GENERATE_PROMPTS = [[1, 2, 3, 4] * 5 + [13], [14, 15]]

# (object, method name) to wrap; the object is found on the engine by the lambda.
STAGES: dict[str, tuple[Callable[[Engine], Any], str]] = {
    "schedule": (lambda engine: engine.scheduler, "schedule"),
    "execute": (lambda engine: engine._executor, "execute"),
    "postprocess": (lambda engine: engine.scheduler, "postprocess"),
    "update": (lambda engine: engine._outputs, "update"),
    # The short bookkeeping path: only while no request needs every step's news.
    "finalize finished": (lambda engine: engine._outputs, "_finalize_finished"),
    "finalize": (lambda engine: RequestState, "finalize"),
    "deliver": (lambda engine: RequestState, "output"),
}


class Injected(RuntimeError):
    pass


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)


FAILURES: dict[str, Callable[[], None]] = {
    "error": lambda: (_ for _ in ()).throw(Injected("injected")),
    "keyboard-interrupt": lambda: (_ for _ in ()).throw(KeyboardInterrupt()),
    "sigint": _sigint,
}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[Engine]:
    # 12 blocks of 16 tokens: the requests below preempt each other.
    with Engine(
        checkpoint,
        device="cpu",
        kv_block_size=16,
        max_model_len=64,
        num_kv_blocks=6,
        max_num_batched_tokens=32,
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> dict[tuple[int, ...], list[int]]:
    prompts = [*STEP_PROMPTS, STREAM_PROMPT, *GENERATE_PROMPTS]
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64) as engine:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outputs, strict=True)}


def _inject(
    monkeypatch: pytest.MonkeyPatch,
    engine: Engine,
    stage: str,
    when: str,
    fail: Callable[[], None],
    on_call: int,
) -> list[int]:
    """Make the ``on_call``-th call of the stage fail once; returns [calls so far]."""
    find, name = STAGES[stage]
    target = find(engine)
    real = getattr(target, name)
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == on_call and when == "before":
            fail()
        result = real(*args, **kwargs)
        if calls[0] == on_call and when == "after":
            fail()
        return result

    monkeypatch.setattr(target, name, wrapper)
    return calls


def _check_idle(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    engine.scheduler.pool.check_integrity()
    stats = engine.stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_waiting == stats.num_running == 0


def _cases(stages: list[str]) -> list[tuple[str, str]]:
    """(stage, failure) pairs, without an error in the executor (a failed step, not an
    interrupted one: test_step_failures.py)."""
    return [
        (stage, failure)
        for stage in stages
        for failure in FAILURES
        if not (stage == "execute" and failure == "error")
    ]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize(
    ("stage", "failure"), _cases([stage for stage in STAGES if stage != "finalize finished"])
)
def test_a_failure_in_a_step_driven_by_step(
    engine: Engine,
    reference: dict[tuple[int, ...], list[int]],
    monkeypatch: pytest.MonkeyPatch,
    stage: str,
    when: str,
    failure: str,
) -> None:
    ids = [engine.add_request(prompt, GREEDY) for prompt in STEP_PROMPTS]
    stream = engine.stream(STREAM_PROMPT, GREEDY)
    deltas: list[RequestOutput] = [next(stream)]
    calls = _inject(monkeypatch, engine, stage, when, FAILURES[failure], on_call=3)

    def drive() -> tuple[dict[str, RequestOutput], int]:
        finals: dict[str, RequestOutput] = {}
        raised = 0
        for _ in range(200):
            try:
                outputs = engine.step()
            except (Injected, KeyboardInterrupt):
                raised += 1
                continue
            for output in outputs:
                if output.finished:
                    assert output.request_id not in finals, "a final output came twice"
                    finals[output.request_id] = output
            if not engine.has_unfinished_requests() and len(finals) == len(ids):
                break
        return finals, raised

    finals, raised = drive()  # in the main thread: a real SIGINT reaches it
    monkeypatch.undo()
    assert calls[0] >= 3 and raised == 1
    deltas.extend(within(lambda: list(stream)))
    assert sorted(finals, key=int) == ids
    for prompt, request_id in zip(STEP_PROMPTS, ids, strict=True):
        assert finals[request_id].outputs[0].finish_reason == "length"
        assert finals[request_id].outputs[0].token_ids == reference[tuple(prompt)]
    assert [t for d in deltas for t in d.outputs[0].token_ids] == reference[tuple(STREAM_PROMPT)]
    assert [d.finished for d in deltas].count(True) == 1
    assert deltas[-1].outputs[0].finish_reason == "length"
    _check_idle(engine)


@pytest.mark.parametrize(
    ("stage", "failure"), _cases(["schedule", "execute", "postprocess", "update", "finalize"])
)
def test_a_failure_in_generate_aborts_only_its_own_requests(
    engine: Engine,
    reference: dict[tuple[int, ...], list[int]],
    monkeypatch: pytest.MonkeyPatch,
    stage: str,
    failure: str,
) -> None:
    other = engine.add_request(STEP_PROMPTS[1], GREEDY)
    _inject(monkeypatch, engine, stage, "after", FAILURES[failure], on_call=3)

    def failing_generate() -> None:
        with pytest.raises((Injected, KeyboardInterrupt)):
            engine.generate(GENERATE_PROMPTS, GREEDY, use_tqdm=False)

    failing_generate()  # in this (the main) thread: a real SIGINT reaches it
    monkeypatch.undo()
    outputs = within(lambda: engine.generate(GENERATE_PROMPTS, GREEDY, use_tqdm=False))
    assert [o.outputs[0].token_ids for o in outputs] == [
        reference[tuple(p)] for p in GENERATE_PROMPTS
    ]
    # The request queued with add_request ran on (perhaps to its end during generate).
    finals: dict[str, RequestOutput] = {}
    for _ in range(100):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests() and finals:
            break
    assert list(finals) == [other]
    assert finals[other].outputs[0].token_ids == reference[tuple(STEP_PROMPTS[1])]
    _check_idle(engine)


@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize(
    ("stage", "on_call"), [("postprocess", 3), ("finalize finished", 3), ("finalize", 1)]
)
def test_a_failure_in_generate_alone(
    engine: Engine,
    reference: dict[tuple[int, ...], list[int]],
    monkeypatch: pytest.MonkeyPatch,
    stage: str,
    on_call: int,
    failure: str,
) -> None:
    """No other request: nothing needs every step's news, so bookkeeping takes the short
    path (only the sequences that finished). A failure there is caught up like any other."""
    calls = _inject(monkeypatch, engine, stage, "after", FAILURES[failure], on_call=on_call)
    with pytest.raises((Injected, KeyboardInterrupt)):
        engine.generate(GENERATE_PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert calls[0] >= on_call  # the aborts that follow finalize too
    outputs = within(lambda: engine.generate(GENERATE_PROMPTS, GREEDY, use_tqdm=False))
    assert [o.outputs[0].token_ids for o in outputs] == [
        reference[tuple(p)] for p in GENERATE_PROMPTS
    ]
    _check_idle(engine)


PENALIZED = SamplingParams(
    temperature=0.0, max_tokens=10, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0
)


CONSTRAINED = SamplingParams(
    temperature=0.0,
    max_tokens=10,
    structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}x{0,4}"),
)


@pytest.mark.parametrize("params", [PENALIZED, CONSTRAINED], ids=["penalties", "grammar"])
@pytest.mark.parametrize(("stage", "when"), [("execute", "after"), ("postprocess", "before")])
def test_a_step_interrupted_before_its_record_counts_its_tokens_once(
    engine: Engine,
    checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    stage: str,
    when: str,
    params: SamplingParams,
) -> None:
    """Ctrl-C between sampling and the record: the step runs again, and what the executor
    derives from sampled tokens as it samples (the penalties' history, a grammar's position)
    must not take the lost step's tokens into account."""
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64) as clean:
        expected = [o.outputs[0].token_ids for o in clean.generate(STEP_PROMPTS, params, False)]
    ids = [engine.add_request(prompt, params) for prompt in STEP_PROMPTS]
    _inject(monkeypatch, engine, stage, when, FAILURES["keyboard-interrupt"], on_call=4)
    finals: dict[str, RequestOutput] = {}
    raised = 0
    for _ in range(200):
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            raised += 1
            continue
        finals.update({o.request_id: o for o in outputs if o.finished})
        if len(finals) == len(ids):
            break
    monkeypatch.undo()
    assert raised == 1
    assert [finals[i].outputs[0].token_ids for i in ids] == expected
    _check_idle(engine)
