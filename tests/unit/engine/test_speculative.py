"""Speculative decoding (issue 26) through the real engine: the outputs of decoding without it.

Verification samples every draft position with the parameters and (seeded rows) the noise of
non-speculative decoding, and keeps the drafts its samples equal, so greedy and seeded
requests must come out exactly as without speculation: tokens, text, finish and stop reasons,
logprobs, through preemption, chunked prefill, prefix hits, ``n > 1``, penalties,
``min_tokens``, stop ids, stop strings and ``max_tokens`` landing inside an accepted run. The
tiny random model repeats itself under greedy decoding, so the n-gram proposer's drafts are
often right: the tests also check that drafts were accepted (else they would prove little).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedinfer import Engine, SamplingParams
from pagedinfer.errors import ConfigurationError, InvalidRequestError

from .test_async_scheduling import (
    OPTIONS as ASYNC_OPTIONS,
)
from .test_async_scheduling import (
    _check_ends,
    _params,
    _prompts,
    _run_staggered,
    _stop_strings,
    _summary,
)

# The async tests' engine with a smaller pool: every workload here preempts.
OPTIONS = ASYNC_OPTIONS | {"num_kv_blocks": 20}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def baseline(checkpoint: Path) -> Iterator[Engine]:
    with Engine(checkpoint, **OPTIONS) as engine:
        yield engine


def _ngram(k: int, low: int = 1, high: int = 3) -> dict[str, object]:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": low,
        "prompt_lookup_max": high,
    }


@pytest.mark.parametrize(("k", "seed", "every"), [(1, 0, 1), (3, 1, 3), (5, 2, 2)])
def test_ngram_equals_no_speculation(
    checkpoint: Path, baseline: Engine, k: int, seed: int, every: int
) -> None:
    prompts = _prompts(seed, 14)
    params = _params(seed, 14, _stop_strings(baseline, prompts))
    expected, _ = _run_staggered(baseline, prompts, params, every)
    with Engine(checkpoint, speculative_config=_ngram(k), **OPTIONS) as engine:
        finals, seen = _run_staggered(engine, prompts, params, every)
        stats = engine.stats()
    for index, (want, got) in enumerate(zip(expected, finals, strict=True)):
        _check_ends(got, params[index], seen)
        assert _summary(got) == _summary(want), f"request {index} differs"
    assert stats.num_preemptions > 0, "the test should preempt"
    assert stats.spec_decode_num_accepted_tokens > 0, "no draft was accepted: a weak test"
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens


def test_greedy_repetition_is_accepted_and_exact(checkpoint: Path, baseline: Engine) -> None:
    """Long greedy runs, where the tiny model loops: most drafts are accepted, and a
    ``max_tokens`` that ends inside an accepted run still ends there."""
    prompts = _prompts(5, 6)
    params = [
        SamplingParams(temperature=0.0, max_tokens=30 + index, ignore_eos=True)
        for index in range(6)
    ]
    expected = baseline.generate(prompts, params, use_tqdm=False)
    with Engine(checkpoint, speculative_config=_ngram(4), **OPTIONS) as engine:
        got = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.stats()
    assert [_summary(o) for o in got] == [_summary(o) for o in expected]
    assert stats.spec_decode_num_accepted_tokens >= stats.spec_decode_num_draft_tokens // 4
    # Fewer steps than tokens: several tokens per verify row.
    assert stats.num_generated_tokens == sum(len(o.outputs[0].token_ids) for o in got)


def test_refusals(checkpoint: Path) -> None:
    with pytest.raises(ConfigurationError, match="async_scheduling"):
        Engine(checkpoint, speculative_config=_ngram(2), async_scheduling=True, **OPTIONS)
    with pytest.raises(ConfigurationError, match="num_speculative_tokens"):
        Engine(checkpoint, speculative_config={"method": "ngram"}, **OPTIONS)
    with pytest.raises(ConfigurationError, match="unknown"):
        Engine(checkpoint, speculative_config=_ngram(2) | {"method": "eagle"}, **OPTIONS)
    with pytest.raises(ConfigurationError, match="not supported"):
        Engine(checkpoint, speculative_config=_ngram(2) | {"depth": 3}, **OPTIONS)
    with Engine(checkpoint, speculative_config=_ngram(2), **OPTIONS) as engine:
        from pagedinfer.domain.structured import StructuredOutputsParams

        constrained = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
        with pytest.raises(InvalidRequestError, match="speculative"):
            engine.generate([[5, 6, 7]], constrained, use_tqdm=False)
        assert not engine.has_unfinished_requests()
        assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)


class _OracleProposer:
    """Drafts from known completions: the first ``right`` tokens true, then wrong ones (so
    every accept length occurs), in place of the engine's n-gram lookup."""

    def __init__(self, completions: dict[tuple[int, ...], list[int]], k: int) -> None:
        self.completions = completions
        self.method = "ngram"  # proposes on the host, as the n-gram lookup does
        self.num_speculative_tokens = k
        self.calls = 0

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        for prompt, completion in self.completions.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                truth = completion[done : done + max_drafts]
                right = (self.calls + done) % (max_drafts + 2)  # 0..k+1: all right, too
                self.calls += 1
                return truth[:right] + [(token + 1) % 250 for token in truth[right:]]
        raise AssertionError("unknown prompt")


def test_penalties_see_the_drafts_before_each_sample(checkpoint: Path, baseline: Engine) -> None:
    """Strong penalties make every sample depend on the tokens before it: a verify sample
    must count the drafts before it (and the history only the kept samples), or the tokens
    after a correct draft differ from decoding without speculation."""
    prompts = _prompts(11, 6)
    params = [
        SamplingParams(
            temperature=0.0 if index % 2 else 0.8,
            seed=77 + index,
            max_tokens=18,
            ignore_eos=True,
            presence_penalty=0.9 if index % 3 != 2 else 0.0,
            frequency_penalty=0.6 if index % 3 != 1 else 0.0,
            repetition_penalty=1.4 if index % 3 == 2 else 1.0,
        )
        for index in range(6)
    ]
    expected = baseline.generate(prompts, params, use_tqdm=False)
    completions = {
        tuple(prompt): list(output.outputs[0].token_ids)
        for prompt, output in zip(prompts, expected, strict=True)
    }
    with Engine(checkpoint, speculative_config=_ngram(3), **OPTIONS) as engine:
        engine.speculation = _OracleProposer(completions, 3)  # type: ignore[assignment]
        got = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.stats()
    assert [_summary(o) for o in got] == [_summary(o) for o in expected]
    assert stats.spec_decode_num_accepted_tokens_per_pos[2] > 0, "full runs were accepted"


@pytest.mark.parametrize("draft", ["same", "smaller"])
def test_draft_model_equals_no_speculation(
    checkpoint: Path, baseline: Engine, make_checkpoint: Callable[..., Path], draft: str
) -> None:
    """A draft model (the target itself: every greedy draft right; a smaller random model:
    mostly wrong) changes nothing in the outputs, with the draft's own cache preempted,
    prefix-hit and copied for forks along with the target's."""
    if draft == "same":
        draft_path = checkpoint
    else:
        draft_path = make_checkpoint("tiny", seed=3, num_hidden_layers=1, hidden_size=32)
    prompts = _prompts(4, 12)
    params = _params(4, 12, _stop_strings(baseline, prompts))
    expected, _ = _run_staggered(baseline, prompts, params, 2)
    config = {"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": 3}
    tight = OPTIONS | {"num_kv_blocks": 17}  # drafts' lookahead blocks: preempts more
    with Engine(checkpoint, speculative_config=config, **tight) as engine:
        finals, seen = _run_staggered(engine, prompts, params, 2)
        assert engine.stats().num_preemptions > 0, "the test should preempt"
        greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        before = engine.stats()
        runs = engine.generate(prompts[:4], greedy, use_tqdm=False)
        after = engine.stats()
        # Every block (the draft's K/V lives in the same block ids) is back in the pool.
        assert after.kv_cache_usage == 0.0
    for index, (want, got) in enumerate(zip(expected, finals, strict=True)):
        _check_ends(got, params[index], seen)
        assert _summary(got) == _summary(want), f"request {index} differs"
    assert [o.outputs[0].token_ids for o in runs] == [
        o.outputs[0].token_ids for o in baseline.generate(prompts[:4], greedy, use_tqdm=False)
    ]
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert drafted > 0
    if draft == "same":  # greedy drafts of the target itself: (nearly) all right
        assert accepted >= 0.9 * drafted


def test_counters_count_verify_rows_as_decoding(checkpoint: Path, baseline: Engine) -> None:
    """Verify rows are chunks in the plan but decoding in the counters: the prompt tokens
    computed are the same as without speculation, and decode throughput is measured."""
    prompts = [[5, 6, 7, 8]] * 4
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    roomy = OPTIONS | {"num_kv_blocks": 64}  # no preemption: no recomputed tokens
    with Engine(checkpoint, **roomy) as plain:
        plain.generate(prompts, greedy, use_tqdm=False)
        expected = plain.stats()
    with Engine(checkpoint, speculative_config=_ngram(3), **roomy) as engine:
        engine.generate(prompts, greedy, use_tqdm=False)
        stats = engine.stats()
    assert stats.num_prompt_tokens == expected.num_prompt_tokens
    assert stats.num_generated_tokens == expected.num_generated_tokens == 4 * 30
    assert stats.decode_throughput > 0
