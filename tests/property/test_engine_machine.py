"""Stateful property test of the Engine on a tiny random checkpoint (CPU, torch backend).

Random interleavings of ``add_request``, ``step``, streams (opened, advanced a few deltas,
closed early, aborted inside their own loop), ``abort`` of any id in any state (queued,
running, finished, unknown), small ``generate`` batches and ``reset_prefix_cache``. Requests
mix every ``SamplingParams`` field (``mixed.py``): greedy, seeded and unseeded sampling, EOS
allowed or ignored, stop strings and stop ids, ``n > 1``, logprobs, penalties, biases and
allowed ids. The pool is small (preemption), the token budget too (chunked prefill), and
prompts share prefixes (prefix-cache hits). Invariants:

* every request ends exactly once, with one final output, delivered to its consumer;
* a greedy or seeded completion equals the same request run alone on a reference engine
  nothing else uses (aborted ones: a prefix of it); every completion keeps its constraints
  (allowed ids, stops, ``min_tokens``, ``max_tokens``, finish and stop reasons, logprobs equal
  to the model's own), whatever ran beside it;
* outputs only grow: each cumulative ``step()`` output and each stream's deltas so far are a
  prefix (tokens and text) of the final output; a stream's deltas add up to exactly what
  ``generate`` would return (its final output is checked rebuilt from them);
* ``abort`` returns True exactly when the request's final output then has an aborted
  completion;
* the pool is intact after every rule and all free when the engine is idle;
* steps are bounded: the executor refuses to run more steps than the work in flight needs.

Size: ``PAGEDINFER_PROPERTY_PROFILE`` (``ci`` by default, see profiles.py) picks the number
of examples; the engines are built once and reused, and each example starts from an idle one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedinfer import Engine, RequestOutput, RequestStream, SamplingParams
from pagedinfer.engine.outputs import CompletionOutput, Logprob

from .mixed import (
    MAX_TOKENS,
    Checker,
    Reference,
    Vocab,
    assert_blocks_all_free,
    describe_vocab,
    prompts,
    sampling_params,
)
from .profiles import sized

SETTINGS = sized(
    {
        "ci": {"max_examples": 100, "stateful_step_count": 30},
        "quick": {"max_examples": 10, "stateful_step_count": 15},
        "thorough": {"max_examples": 1000, "stateful_step_count": 60},
    }
)
ENGINE_OPTIONS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 4,
    "max_model_len": 48,
    "num_kv_blocks": 14,  # 56 token slots: two long requests already preempt each other
    "max_num_batched_tokens": 16,  # prompts up to 24 tokens: chunked prefill
    "max_num_seqs": 4,
}
# The same machine with one step in flight (async scheduling): fewer examples, the rules and
# invariants unchanged (a step planned ahead must not change any output).
ASYNC_SETTINGS = sized(
    {
        "ci": {"max_examples": 20, "stateful_step_count": 30},
        "quick": {"max_examples": 5, "stateful_step_count": 15},
        "thorough": {"max_examples": 500, "stateful_step_count": 60},
    }
)


@dataclass
class Setup:
    """What the examples share: the reference, the vocabulary, the engine under test."""

    checkpoint: Path
    reference: Reference
    vocab: Vocab
    engine: Engine | None = None
    checker: Checker | None = None
    options: dict[str, Any] = field(default_factory=lambda: dict(ENGINE_OPTIONS))

    def ready(self) -> tuple[Engine, Checker]:
        """The engine under test; a new one if a failed example killed the previous one (so
        that shrinking replays each example on a live engine)."""
        if self.engine is None or self.engine.is_dead:
            if self.engine is not None:
                self.engine.close()
            self.engine = Engine(self.checkpoint, **self.options)
            self.checker = Checker(self.engine, self.reference)
        assert self.checker is not None
        return self.engine, self.checker


@pytest.fixture(scope="module")
def machine_setup(make_checkpoint: Callable[..., Path]) -> Iterator[Setup]:
    checkpoint = make_checkpoint("tiny", with_tokenizer=True)
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64) as fresh:
        setup = Setup(checkpoint, Reference(fresh), describe_vocab(fresh))
        try:
            yield setup
        finally:
            if setup.engine is not None:
                setup.engine.close()


@dataclass
class Streamed:
    """One completion as a stream's deltas built it up."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Tracked:
    """What the test knows about one request."""

    prompt: list[int]
    params: SamplingParams
    consumer: str  # "step", "stream" or "generate"
    finals: list[RequestOutput] = field(default_factory=list)
    seen: list[RequestOutput] = field(default_factory=list)  # cumulative step() outputs
    streamed: dict[int, Streamed] = field(default_factory=dict)  # by completion index
    prompt_logprobs: Any = None  # from the stream's first delta
    num_cached_tokens: int = 0
    aborted: bool = False  # abort() returned True for it
    abandoned: bool = False  # its stream was closed before the final delta


class EngineMachine(RuleBasedStateMachine):
    """The rules that need no strategy of the checkpoint's vocabulary; :func:`machine_for`
    adds the ones that queue requests."""

    setup: Setup
    requests = Bundle("requests")

    @initialize()
    def start(self) -> None:
        self.engine, self.checker = self.setup.ready()
        self.tracked: dict[str, Tracked] = {}
        self.streams: dict[str, RequestStream] = {}  # open streams by request id
        self.steps = 0
        assert not self.engine.has_unfinished_requests(), "the previous example left work"
        assert self.engine.step() == []
        self.install_step_budget()

    # ------------------------------------------------------------------ helpers
    def install_step_budget(self) -> None:
        """Bounded steps: refuse a step beyond what the work in flight could need."""
        executor = self.engine._executor
        assert executor is not None
        # Launch: what execute() runs, and what the engine calls with async scheduling.
        real = type(executor).launch.__get__(executor)
        machine = self

        def counted(plan: Any) -> Any:
            machine.steps += 1
            budget = 2 * sum(
                (len(t.prompt) + (t.params.max_tokens or 0) + 2) * t.params.n
                for t in machine.tracked.values()
            )
            assert machine.steps <= budget + 20, "the engine stepped far more than needed"
            return real(plan)

        executor.launch = counted  # type: ignore[method-assign]

    def track(self, request_id: str, prompt: list[int], params: SamplingParams, kind: str) -> None:
        assert request_id not in self.tracked
        self.tracked[request_id] = Tracked(prompt, params, kind)

    def record_final(self, request_id: str, final: RequestOutput) -> None:
        tracked = self.tracked[request_id]
        assert not tracked.finals, f"request {request_id} got a second final output"
        assert final.finished and final.request_id == request_id
        tracked.finals.append(final)
        aborted = any(c.finish_reason == "abort" for c in final.outputs)
        if aborted:
            assert tracked.aborted, "an abort nobody asked for"
        else:
            assert not tracked.aborted, "abort() said True but no completion was aborted"
        self.checker.check_final(final, tracked.prompt, tracked.params)
        for earlier in tracked.seen:  # cumulative outputs only grow
            for before, after in zip(earlier.outputs, final.outputs, strict=True):
                assert after.token_ids[: len(before.token_ids)] == before.token_ids
                assert after.text.startswith(before.text), (before.text, after.text)

    def take_stream_delta(self, request_id: str) -> RequestOutput:
        delta = next(self.streams[request_id])
        tracked = self.tracked[request_id]
        assert delta.request_id == request_id
        if delta.prompt_logprobs is not None:
            assert tracked.prompt_logprobs is None, "prompt logprobs in a second delta"
            tracked.prompt_logprobs = delta.prompt_logprobs
        tracked.num_cached_tokens = delta.num_cached_tokens
        for piece in delta.outputs:
            whole = tracked.streamed.setdefault(piece.index, Streamed())
            assert whole.finish_reason is None, "a delta after the completion finished"
            whole.tokens.extend(piece.token_ids)
            whole.text += piece.text
            if piece.logprobs is not None:
                whole.logprobs = [*(whole.logprobs or []), *piece.logprobs]
            whole.cumulative_logprob = piece.cumulative_logprob
            whole.finish_reason = piece.finish_reason
            whole.stop_reason = piece.stop_reason
        if delta.finished:
            del self.streams[request_id]
            self.record_final(request_id, self.rebuilt(request_id, delta))
        return delta

    def rebuilt(self, request_id: str, last: RequestOutput) -> RequestOutput:
        """The cumulative output a stream's deltas add up to."""
        tracked = self.tracked[request_id]
        completions = []
        for index in range(tracked.params.n):
            whole = tracked.streamed.get(index, Streamed())  # each shows up when it finishes
            completions.append(
                CompletionOutput(
                    index=index,
                    text=whole.text,
                    token_ids=whole.tokens,
                    cumulative_logprob=whole.cumulative_logprob,
                    logprobs=whole.logprobs,
                    finish_reason=whole.finish_reason,
                    stop_reason=whole.stop_reason,
                )
            )
        return RequestOutput(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=last.prompt_token_ids,
            prompt_logprobs=tracked.prompt_logprobs,
            outputs=completions,
            finished=True,
            num_cached_tokens=tracked.num_cached_tokens,
        )

    # -------------------------------------------------------------------- rules
    @rule()
    def step(self) -> None:
        for output in self.engine.step():
            tracked = self.tracked[output.request_id]
            assert tracked.consumer == "step", "step() returned another consumer's output"
            assert not tracked.finals, "an output after the final one"
            if output.finished:
                self.record_final(output.request_id, output)
            else:
                tracked.seen.append(output)

    @precondition(lambda self: self.streams)
    @rule(
        which=st.integers(0, 7), count=st.integers(1, 4), abort_after=st.none() | st.integers(0, 3)
    )
    def advance_stream(self, which: int, count: int, abort_after: int | None) -> None:
        request_id = sorted(self.streams)[which % len(self.streams)]
        for index in range(count):
            if request_id not in self.streams:
                return
            self.take_stream_delta(request_id)
            if index == abort_after and request_id in self.streams:  # inside its own loop
                self.abort(request_id)

    @precondition(lambda self: self.streams)
    @rule(which=st.integers(0, 7))
    def close_stream(self, which: int) -> None:
        request_id = sorted(self.streams)[which % len(self.streams)]
        self.streams.pop(request_id).close()
        self.tracked[request_id].abandoned = True  # its consumer left: no final expected

    @rule(request_id=st.one_of(requests, st.integers(10**6, 10**6 + 3).map(str)))
    def abort(self, request_id: str) -> None:
        tracked = self.tracked.get(request_id)
        found = self.engine.abort(request_id)
        if tracked is None or tracked.finals or tracked.abandoned:
            assert not found, "abort() of an unknown or finished request said True"
        elif found:
            tracked.aborted = True

    @rule()
    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    # --------------------------------------------------------------- invariants
    @invariant()
    def pool_is_intact_and_free_when_idle(self) -> None:
        self.engine.scheduler.pool.check_integrity()
        if not self.engine.has_unfinished_requests():
            assert_blocks_all_free(self.engine)

    def teardown(self) -> None:
        """Finish everything, then check each request ended exactly once."""
        try:
            for request_id in list(self.streams):
                for _ in range(2 * MAX_TOKENS + 2):
                    if request_id not in self.streams:
                        break
                    self.take_stream_delta(request_id)
                assert request_id not in self.streams, "a stream did not end"
            for _ in range(1000):
                if not self.engine.has_unfinished_requests():
                    break
                self.step()
            self.step()  # finals that finished during the last generate()
            assert not self.engine.has_unfinished_requests()
            for request_id, tracked in self.tracked.items():
                if tracked.abandoned:
                    assert not tracked.finals or tracked.consumer != "stream"
                else:
                    assert len(tracked.finals) == 1, f"request {request_id} never ended"
            assert_blocks_all_free(self.engine)
        finally:
            executor = self.engine._executor
            assert executor is not None
            vars(executor).pop("launch", None)  # the real method again
            # Whatever failed above, leave the shared engine idle for the next example (a
            # failed step may leave outputs to collect, or an error to raise once).
            for request_id in list(self.engine._table.requests):
                self.engine.abort(str(request_id))
            for _ in range(2):
                with contextlib.suppress(Exception):
                    self.engine.step()


def machine_for(setup: Setup) -> type[EngineMachine]:
    """The machine with the rules that queue requests drawn from ``setup.vocab``."""
    prompt = prompts(setup.vocab)
    params = sampling_params(setup.vocab)

    class Machine(EngineMachine):
        requests = EngineMachine.requests

        @rule(target=requests, prompt=prompt, params=params)
        def add_request(self, prompt: list[int], params: SamplingParams) -> str:
            request_id = self.engine.add_request(prompt, params)
            self.track(request_id, prompt, params, "step")
            return request_id

        @rule(target=requests, prompt=prompt, params=params)
        def open_stream(self, prompt: list[int], params: SamplingParams) -> str:
            stream = self.engine.stream(prompt, params)
            self.track(stream.request_id, prompt, params, "stream")
            self.streams[stream.request_id] = stream
            return stream.request_id

        @rule(batch=st.lists(st.tuples(prompt, params), min_size=1, max_size=3))
        def generate(self, batch: list[tuple[list[int], SamplingParams]]) -> None:
            prompt_list = [p for p, _ in batch]
            outputs = self.engine.generate(prompt_list, [p for _, p in batch], use_tqdm=False)
            assert len(outputs) == len(batch)
            for (request_prompt, request_params), output in zip(batch, outputs, strict=True):
                self.track(output.request_id, request_prompt, request_params, "generate")
                self.record_final(output.request_id, output)

    Machine.setup = setup
    return Machine


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_engine_state_machine(machine_setup: Setup) -> None:
    run_state_machine_as_test(machine_for(machine_setup), settings=SETTINGS)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_engine_state_machine_async_scheduling(machine_setup: Setup) -> None:
    setup = Setup(
        machine_setup.checkpoint,
        machine_setup.reference,
        machine_setup.vocab,
        options={**ENGINE_OPTIONS, "async_scheduling": True},
    )
    try:
        run_state_machine_as_test(machine_for(setup), settings=ASYNC_SETTINGS)
    finally:
        if setup.engine is not None:
            setup.engine.close()
