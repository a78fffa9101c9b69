"""Stateful property test of the Engine on a tiny random checkpoint (CPU, torch backend).

Random interleavings of ``add_request``, ``step``, streams (opened, advanced a few deltas,
closed early, aborted inside their own loop), ``abort`` of any id in any state (queued,
running, finished, unknown), small ``generate`` batches and ``reset_prefix_cache``. The pool
is small (preemption), the token budget too (chunked prefill), and prompts share prefixes
(prefix-cache hits). Invariants:

* every request ends exactly once, with one final output, delivered to its consumer;
* greedy tokens equal those of a fresh engine that ran the prompt alone (aborted requests:
  a prefix of them);
* ``abort`` returns True exactly when the request's final output then says ``"abort"``;
* the pool is intact after every rule and all free when the engine is idle;
* steps are bounded: the executor refuses to run more steps than the work in flight needs.

Size: ``PAGEDINFER_PROPERTY_PROFILE`` (``ci`` by default, see conftest.py) picks the number
of examples; the engine is built once and reused, and each example starts from an idle one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
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

_SIZES = {
    "ci": {"max_examples": 200, "stateful_step_count": 30},
    "quick": {"max_examples": 10, "stateful_step_count": 15},
    "thorough": {"max_examples": 1000, "stateful_step_count": 60},
}
_SETTINGS = settings(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    **_SIZES[os.environ.get("PAGEDINFER_PROPERTY_PROFILE", "ci")],  # type: ignore[arg-type]
)

MAX_TOKENS = 8
PREFIX = list(range(1, 37))  # shared by many prompts: full blocks of 4 get cached
ENGINE_OPTIONS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 4,
    "max_model_len": 48,
    "num_kv_blocks": 14,  # 56 token slots: two long requests already preempt each other
    "max_num_batched_tokens": 16,  # prompts up to 39 tokens: chunked prefill
    "max_num_seqs": 4,
}
PROMPT = st.builds(
    lambda cut, tail: PREFIX[:cut] + tail,
    st.sampled_from([0, 5, 12, 20, 36]),
    st.lists(st.integers(40, 60), min_size=1, max_size=3),
)
PARAMS = st.tuples(st.integers(1, MAX_TOKENS), st.none() | st.integers(0, MAX_TOKENS - 1))


@pytest.fixture(scope="module")
def machine_engine(make_checkpoint: Callable[..., Path]) -> Iterator[tuple[Engine, Engine]]:
    checkpoint = make_checkpoint("tiny", with_tokenizer=True)
    with (
        Engine(checkpoint, **ENGINE_OPTIONS) as engine,
        Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=48) as fresh,
    ):
        yield engine, fresh


@dataclass
class Tracked:
    """What the test knows about one request."""

    prompt: list[int]
    params: SamplingParams
    expected: list[int]  # greedy tokens, cut at the stop token if any
    reason: str  # the finish reason unless aborted
    consumer: str  # "step", "stream" or "generate"
    finals: list[RequestOutput] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # streamed so far
    aborted: bool = False  # abort() returned True for it
    abandoned: bool = False  # its stream was closed before the final delta


class EngineMachine(RuleBasedStateMachine):
    engine: Engine
    fresh: Engine
    references: dict[tuple[int, ...], list[int]]

    requests = Bundle("requests")

    @initialize()
    def start(self) -> None:
        assert not self.engine.has_unfinished_requests(), "the previous example left work"
        assert self.engine.step() == []
        self.tracked: dict[int, Tracked] = {}
        self.streams: dict[int, RequestStream] = {}  # open streams by request id
        self.steps = 0
        self.install_step_budget()

    # ------------------------------------------------------------------ helpers
    def install_step_budget(self) -> None:
        """Bounded steps: refuse a step beyond what the work in flight could need."""
        executor = self.engine._executor
        assert executor is not None
        real = type(executor).execute.__get__(executor)
        machine = self

        def counted(plan: Any) -> list[int]:
            machine.steps += 1
            budget = 2 * sum(
                len(t.prompt) + t.params.max_tokens + 2 for t in machine.tracked.values()
            )
            assert machine.steps <= budget + 20, "the engine stepped far more than needed"
            return real(plan)  # type: ignore[no-any-return]

        executor.execute = counted  # type: ignore[method-assign]

    def expected_tokens(self, prompt: list[int], params: SamplingParams) -> list[int]:
        key = tuple(prompt)
        if key not in self.references:
            greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            (output,) = self.fresh.generate([prompt], greedy, use_tqdm=False)
            self.references[key] = output.outputs[0].token_ids
        tokens = self.references[key][: params.max_tokens]
        for index, token in enumerate(tokens):
            if token in params.stop_token_ids:
                return tokens[: index + 1]
        return tokens

    def make_params(self, prompt: list[int], choice: tuple[int, int | None]) -> SamplingParams:
        max_tokens, stop_at = choice
        stops: tuple[int, ...] = ()
        if stop_at is not None:
            greedy = self.expected_tokens(prompt, SamplingParams(max_tokens=MAX_TOKENS))
            stops = (greedy[stop_at],)
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stops
        )

    def track(self, request_id: int, prompt: list[int], params: SamplingParams, kind: str) -> None:
        assert request_id not in self.tracked
        expected = self.expected_tokens(prompt, params)
        stopped = expected[-1] in params.stop_token_ids  # checked before the length rule
        reason = "stop" if stopped else "length"
        self.tracked[request_id] = Tracked(prompt, params, expected, reason, kind)

    def record_final(self, request_id: int, final: RequestOutput) -> None:
        tracked = self.tracked[request_id]
        assert not tracked.finals, f"request {request_id} got a second final output"
        tracked.finals.append(final)

    def check_tokens(self, tracked: Tracked, tokens: list[int], reason: str | None) -> None:
        if reason == "abort":
            assert tracked.aborted, "an abort nobody asked for"
            assert tokens == tracked.expected[: len(tokens)]
        else:
            assert not tracked.aborted, "abort() said True but the request did not abort"
            assert (tokens, reason) == (tracked.expected, tracked.reason)

    def take_stream_delta(self, request_id: int) -> RequestOutput:
        delta = next(self.streams[request_id])
        tracked = self.tracked[request_id]
        assert delta.request_id == request_id
        tracked.tokens.extend(delta.outputs[0].token_ids)
        assert tracked.tokens == tracked.expected[: len(tracked.tokens)] or tracked.aborted
        if delta.finished:
            self.record_final(request_id, delta)
            self.check_tokens(tracked, tracked.tokens, delta.outputs[0].finish_reason)
            del self.streams[request_id]
        return delta

    # -------------------------------------------------------------------- rules
    @rule(target=requests, prompt=PROMPT, choice=PARAMS)
    def add_request(self, prompt: list[int], choice: tuple[int, int | None]) -> int:
        params = self.make_params(prompt, choice)
        request_id = self.engine.add_request(prompt, params)
        self.track(request_id, prompt, params, "step")
        return request_id

    @rule()
    def step(self) -> None:
        for output in self.engine.step():
            tracked = self.tracked[output.request_id]
            assert tracked.consumer == "step", "step() returned another consumer's output"
            assert not tracked.finals, "an output after the final one"
            if output.finished:
                self.record_final(output.request_id, output)
                self.check_tokens(
                    tracked, output.outputs[0].token_ids, output.outputs[0].finish_reason
                )
            else:
                assert (
                    output.outputs[0].token_ids
                    == tracked.expected[: len(output.outputs[0].token_ids)]
                )

    @rule(target=requests, prompt=PROMPT, choice=PARAMS)
    def open_stream(self, prompt: list[int], choice: tuple[int, int | None]) -> int:
        params = self.make_params(prompt, choice)
        stream = self.engine.stream(prompt, params)
        self.track(stream.request_id, prompt, params, "stream")
        self.streams[stream.request_id] = stream
        return stream.request_id

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

    @rule(request_id=st.one_of(requests, st.integers(10**6, 10**6 + 3)))
    def abort(self, request_id: int) -> None:
        tracked = self.tracked.get(request_id)
        found = self.engine.abort(request_id)
        if tracked is None or tracked.finals or tracked.abandoned:
            assert not found, "abort() of an unknown or finished request said True"
        elif found:
            tracked.aborted = True

    @rule(batch=st.lists(st.tuples(PROMPT, PARAMS), min_size=1, max_size=3))
    def generate(self, batch: list[tuple[list[int], tuple[int, int | None]]]) -> None:
        prompts = [prompt for prompt, _ in batch]
        params = [self.make_params(prompt, choice) for prompt, choice in batch]
        outputs = self.engine.generate(prompts, params, use_tqdm=False)
        assert len(outputs) == len(batch)
        for prompt, request_params, output in zip(prompts, params, outputs, strict=True):
            self.track(output.request_id, prompt, request_params, "generate")
            assert output.finished and output.prompt_token_ids == prompt
            self.record_final(output.request_id, output)
            self.check_tokens(
                self.tracked[output.request_id],
                output.outputs[0].token_ids,
                output.outputs[0].finish_reason,
            )

    @rule()
    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    # --------------------------------------------------------------- invariants
    @invariant()
    def pool_is_intact_and_free_when_idle(self) -> None:
        pool = self.engine.scheduler.pool
        pool.check_integrity()
        if not self.engine.has_unfinished_requests():
            assert pool.num_free_blocks == pool.num_blocks

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
            pool = self.engine.scheduler.pool
            assert pool.num_free_blocks == pool.num_blocks
        finally:
            executor = self.engine._executor
            assert executor is not None
            vars(executor).pop("execute", None)  # the real method again
            # Whatever failed above, leave the shared engine idle for the next example.
            for request_id in list(self.engine._requests):
                self.engine.abort(request_id)
            self.engine.step()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_engine_state_machine(machine_engine: tuple[Engine, Engine]) -> None:
    engine, fresh = machine_engine
    references: dict[tuple[int, ...], list[int]] = {}

    class Machine(EngineMachine):
        pass

    Machine.engine = engine
    Machine.fresh = fresh
    Machine.references = references
    run_state_machine_as_test(Machine, settings=_SETTINGS)
