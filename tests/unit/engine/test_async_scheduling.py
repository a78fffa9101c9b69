"""Async scheduling (issue 24): one step in flight gives exactly the outputs of the sync loop.

``Engine(async_scheduling=True)`` plans step N+1 before step N's tokens are back and runs the
steps on a worker thread. Greedy and seeded requests must come out identical to the sync
engine (tokens, text, finish and stop reasons, logprobs) through preemption (a small pool),
chunked prefill and mixed steps (a small token budget, staggered arrivals), prefix-cache hits
(shared prefixes), ``n > 1`` forks, penalties, ``min_tokens``, stop ids and stop strings; no
request may emit a token after its end, in its final output or in any step's output; a step
in flight that fails fails its requests only; settings that cannot run it are refused.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import Engine, RequestOutput, SamplingParams
from pagedinfer.errors import ConfigurationError, StepFailedError

# Small on purpose: 4-token blocks, 26 of them (preemption with a few long requests), a
# 12-token budget (chunked prefill, mixed steps), at most 5 sequences at once.
OPTIONS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 4,
    "num_kv_blocks": 26,
    "max_model_len": 64,
    "max_num_batched_tokens": 12,
    "max_num_seqs": 5,
}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def engines(checkpoint: Path) -> Iterator[dict[bool, Engine]]:
    built = {flag: Engine(checkpoint, async_scheduling=flag, **OPTIONS) for flag in (False, True)}
    yield built
    for engine in built.values():
        engine.close()


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(9)]
    prompts = []
    for index in range(count):
        own = [rng.randrange(3, 250) for _ in range(rng.randint(1, 22))]
        prompts.append(system + own if index % 3 == 0 else own)  # prefix-cache hits
    return prompts


def _params(seed: int, count: int, stops: list[str]) -> list[SamplingParams]:
    rng = random.Random(seed)
    params = []
    for index in range(count):
        max_tokens = rng.randint(1, 24)
        params.append(
            SamplingParams(
                temperature=0.0 if index % 2 else 0.9,
                seed=1000 + index,  # seeded: reproducible beside any other rows
                max_tokens=max_tokens,
                min_tokens=rng.randint(0, max_tokens),
                n=2 if index % 5 == 1 else 1,
                stop_token_ids=rng.sample(range(3, 250), 12),
                stop=stops[index % len(stops)] if stops and index % 3 == 2 else None,
                ignore_eos=index % 4 == 0,
                repetition_penalty=1.3 if index % 6 == 3 else 1.0,
                presence_penalty=0.5 if index % 7 == 4 else 0.0,
                logprobs=2 if index % 4 == 1 else None,
            )
        )
    return params


def _run_staggered(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams], every: int
) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """Add a request every ``every`` steps while the others run (mixed steps); the final
    outputs in prompt order, and every output ``step()`` returned."""
    pending = list(range(len(prompts)))
    index_of: dict[str, int] = {}
    finals: dict[int, RequestOutput] = {}
    seen: list[RequestOutput] = []
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % every == 0:
            index = pending.pop(0)
            index_of[engine.add_request(prompts[index], params[index])] = index
        for output in engine.step():
            seen.append(output)
            if output.finished:
                assert index_of[output.request_id] not in finals, "a second final output"
                finals[index_of[output.request_id]] = output
        steps += 1
        assert steps < 5_000
    return [finals[index] for index in range(len(prompts))], seen


def _summary(output: RequestOutput) -> list[tuple[Any, ...]]:
    """What must be identical: tokens, text, finish and stop reasons, and the logprobs'
    token ids and ranks; their values to float32 rounding (a step planned ahead holds the
    rows of sequences that finished meanwhile, so the batch, and the GEMMs' summation order,
    can differ from the sync loop's)."""
    return [
        (
            completion.token_ids,
            completion.text,
            completion.finish_reason,
            completion.stop_reason,
            None
            if completion.logprobs is None
            else [
                {
                    token: (entry.rank, pytest.approx(entry.logprob, abs=1e-4))
                    for token, entry in step.items()
                }
                for step in completion.logprobs
            ],
        )
        for completion in output.outputs
    ]


def _stop_strings(engine: Engine, prompts: list[list[int]]) -> list[str]:
    """Pieces of text the model does produce (so that stop strings really stop)."""
    outputs = engine.generate(
        prompts[:6], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )
    texts = [output.outputs[0].text for output in outputs]
    return [text[len(text) // 2 : len(text) // 2 + 2] for text in texts if len(text) > 4]


def _check_ends(output: RequestOutput, params: SamplingParams, seen: list[RequestOutput]) -> None:
    """No token after the end: the stop id (if it stopped on one) is the last token, no more
    than ``max_tokens``, and no step output showed more than the final one."""
    for completion in output.outputs:
        tokens = completion.token_ids
        assert len(tokens) <= (params.max_tokens or 0)
        stop_ids = set(params.stop_token_ids)
        held_back = [t for t in tokens[params.min_tokens : -1] if t in stop_ids]
        assert not held_back, f"tokens after a stop id: {tokens}"
        if completion.finish_reason == "length":
            assert len(tokens) == params.max_tokens
        if completion.finish_reason == "stop" and isinstance(completion.stop_reason, int):
            assert tokens[-1] == completion.stop_reason
    for earlier in seen:
        if earlier.request_id != output.request_id:
            continue
        for before, final in zip(earlier.outputs, output.outputs, strict=True):
            assert final.token_ids[: len(before.token_ids)] == before.token_ids, (
                "a step's output held a token past the request's end"
            )


@pytest.mark.parametrize(("seed", "every"), [(0, 1), (1, 3)])
def test_async_equals_sync(engines: dict[bool, Engine], seed: int, every: int) -> None:
    prompts = _prompts(seed, 14)
    params = _params(seed, 14, _stop_strings(engines[False], prompts))
    results = {flag: _run_staggered(engines[flag], prompts, params, every) for flag in engines}
    sync, _ = results[False]
    finals, seen = results[True]
    for index, (expected, got) in enumerate(zip(sync, finals, strict=True)):
        _check_ends(got, params[index], seen)
        assert _summary(got) == _summary(expected), f"request {index} differs"
    assert engines[True].stats().num_preemptions > 0, "the test should preempt"
    assert any(c.finish_reason == "stop" for out in sync for c in out.outputs)
    assert any(isinstance(c.stop_reason, str) for out in sync for c in out.outputs)


def test_generate_batches_equal(engines: dict[bool, Engine]) -> None:
    """generate(): everything queued at once (prefill steps, then one step planned ahead of
    each decode step), and a second batch while the first one's last step may be in flight."""
    prompts = _prompts(7, 10)
    params = _params(7, 10, [])
    for flag in engines:
        assert not engines[flag].has_unfinished_requests()
    got = [engines[True].generate(prompts, params, use_tqdm=False) for _ in range(2)]
    expected = engines[False].generate(prompts, params, use_tqdm=False)
    for outputs in got:
        assert [_summary(o) for o in outputs] == [_summary(o) for o in expected]


def test_a_failed_step_in_flight_fails_its_requests_only(checkpoint: Path) -> None:
    """The step the host waits for raises: its requests fail, the step planned ahead of it
    is dropped and planned again, and the others get exactly their sync tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = _prompts(3, 4)
    with Engine(checkpoint, async_scheduling=False, **OPTIONS) as engine:
        expected = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy, False)]
    with Engine(checkpoint, async_scheduling=True, **OPTIONS) as engine:
        executor = engine._executor
        assert executor is not None
        real = executor.launch  # type: ignore[attr-defined]
        calls = 0

        def flaky(plan: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 3:
                raise RuntimeError("injected")
            return real(plan)

        executor.launch = flaky  # type: ignore[attr-defined]
        ids = [engine.add_request(prompt, greedy) for prompt in prompts]
        with pytest.raises(StepFailedError) as failure:
            while engine.has_unfinished_requests():
                engine.step()
        failed = set(failure.value.request_ids)
        assert failed and failed < set(ids)
        finals: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests() or len(finals) < len(ids):
            for output in engine.step():
                if output.finished:
                    finals[output.request_id] = output
        for request_id, tokens in zip(ids, expected, strict=True):
            completion = finals[request_id].outputs[0]
            if request_id in failed:
                assert completion.finish_reason == "abort"
            else:
                assert completion.token_ids == tokens
        assert engine.scheduler.pool.stats().usage == 0.0


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton backend needs TRITON_INTERPRET"
)
def test_triton_backend_async_equals_sync(checkpoint: Path) -> None:
    prompts = _prompts(5, 3)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=4, n=1 + i % 2)
        for i in range(3)
    ]
    outputs = {}
    for flag in (False, True):
        with Engine(
            checkpoint,
            async_scheduling=flag,
            **{**OPTIONS, "attention_backend": "triton", "kv_block_size": 16, "num_kv_blocks": 8},
        ) as engine:
            outputs[flag] = [_summary(o) for o in engine.generate(prompts, params, False)]
    assert outputs[True] == outputs[False]


def test_settings_that_cannot_run_it_are_refused(checkpoint: Path) -> None:
    with pytest.raises(ConfigurationError, match="pipeline_parallel_size"):
        Engine(
            checkpoint,
            async_scheduling=True,
            pipeline_parallel_size=2,
            distributed_executor_backend="ray",
            **OPTIONS,
        )
    with pytest.raises(ConfigurationError, match="async_scheduling"):
        Engine(checkpoint, async_scheduling="yes", **OPTIONS)  # type: ignore[arg-type]


def test_the_switch_reaches_the_engine(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LLM takes it as an Engine argument (no longer a vLLM argument it ignores); the CLI's
    --async-scheduling / --no-async-scheduling pass it on (absent: None, the default)."""
    from pagedinfer import LLM, cli

    with LLM(model=str(checkpoint), async_scheduling=True, **OPTIONS) as llm:
        assert llm.async_scheduling
    seen: list[Any] = []
    monkeypatch.setitem(cli._COMMANDS, "generate", lambda args: seen.append(args) or 0)
    for flags, value in (
        ([], None),
        (["--async-scheduling"], True),
        (["--no-async-scheduling"], False),
    ):
        assert cli.main(["generate", "m", "--prompt", "x", *flags]) == 0
        assert cli._engine_kwargs(seen[-1])["async_scheduling"] is value, flags
