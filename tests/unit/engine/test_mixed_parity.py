"""Greedy parity with transformers when prefill chunks ride along with decode rows.

Requests arrive while others decode (``Engine.add_request`` between ``step`` calls), so the
default ``mixed`` scheduling policy runs mixed steps: decode rows and prefill chunks in one
forward. Tiny token budgets, prefix-cache hits and forced preemption (recompute chunks mixed
with decode rows) must all give exactly transformers' tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hf_reference import hf_greedy
from pagedinfer import Engine, SamplingParams

MAX_TOKENS = 10


def _prompts(seed: int, count: int, vocab: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(40)]
    prompts = []
    for index in range(count):
        own = [rng.randrange(vocab) for _ in range(rng.randint(*lengths))]
        prompts.append(system + own if index % 3 == 1 else own)  # some share a prefix
    return prompts


def _run_staggered(engine: Engine, prompts: list[list[int]], every: int) -> list[Any]:
    """Add one prompt every ``every`` steps while the others run; the final outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    pending = list(enumerate(prompts))
    index_of: dict[int, int] = {}
    finals: dict[int, Any] = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % every == 0:
            index, prompt = pending.pop(0)
            index_of[engine.add_request(prompt, params)] = index
        for output in engine.step():
            if output.finished:
                finals[index_of[output.request_id]] = output
        steps += 1
        assert steps < 10_000
    return [finals[index] for index in range(len(prompts))]


def _check(engine: Engine, checkpoint: Path, prompts: list[list[int]], every: int = 2) -> None:
    for prompt, output in zip(prompts, _run_staggered(engine, prompts, every), strict=True):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == hf_greedy(checkpoint, prompt, MAX_TOKENS), (
            f"mismatch for a prompt of {len(prompt)} tokens"
        )


SHAPES = {
    "gqa-tied": {},
    "mha-untied": {"num_key_value_heads": 4, "tie_word_embeddings": False},
    "wide-head": {
        "hidden_size": 48,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "tie_word_embeddings": False,
    },
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_mixed_steps_match_transformers(make_checkpoint: Callable[..., Path], shape: str) -> None:
    checkpoint = make_checkpoint("tiny", **SHAPES[shape])
    prompts = _prompts(11, 8, 512, (1, 60))
    with Engine(
        checkpoint, device="cpu", kv_block_size=16, max_model_len=256, max_num_batched_tokens=24
    ) as engine:
        _check(engine, checkpoint, prompts)
        _check(engine, checkpoint, prompts[::-1], every=1)  # warm prefix cache
        stats = engine.scheduler.stats()
        assert stats.num_mixed_steps > 0
        assert engine.stats().prefix_cache_hit_rate > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mixed_steps_with_preemption(
    make_checkpoint: Callable[..., Path], prefix_caching: bool
) -> None:
    checkpoint = make_checkpoint("tiny")
    prompts = _prompts(12, 8, 512, (20, 48))
    with Engine(
        checkpoint,
        device="cpu",
        kv_block_size=16,
        max_model_len=128,
        num_kv_blocks=9,
        max_num_batched_tokens=32,
        enable_prefix_caching=prefix_caching,
    ) as engine:
        _check(engine, checkpoint, prompts, every=1)
        stats = engine.scheduler.stats()
        assert stats.num_preemptions > 0 and stats.num_mixed_steps > 0


def test_a_budget_barely_above_the_decode_rows(make_checkpoint: Callable[..., Path]) -> None:
    # Four sequences at most and five tokens a step: prompts go in chunks of one to four
    # tokens beside up to four decode rows.
    checkpoint = make_checkpoint("tiny")
    prompts = _prompts(13, 6, 512, (5, 30))
    with Engine(
        checkpoint,
        device="cpu",
        kv_block_size=16,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=5,
    ) as engine:
        _check(engine, checkpoint, prompts, every=3)
        assert engine.scheduler.stats().num_mixed_steps > 0


def test_the_prefill_first_policy_stays_selectable(make_checkpoint: Callable[..., Path]) -> None:
    checkpoint = make_checkpoint("tiny")
    prompts = _prompts(14, 4, 512, (5, 40))
    with Engine(
        checkpoint,
        device="cpu",
        kv_block_size=16,
        max_model_len=128,
        max_num_batched_tokens=16,
        scheduling_policy="prefill_first",
    ) as engine:
        _check(engine, checkpoint, prompts)
        stats = engine.scheduler.stats()
        assert stats.num_mixed_steps == 0 and stats.num_prefill_steps > len(prompts)


def test_an_unknown_scheduling_policy_is_refused(make_checkpoint: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="scheduling_policy='fifo' is unknown"):
        Engine(make_checkpoint("tiny"), device="cpu", scheduling_policy="fifo")


def test_the_cli_passes_the_scheduling_policy_on() -> None:
    from pagedinfer.cli import _build_parser, _engine_kwargs

    parser = _build_parser()
    default = parser.parse_args(["generate", "--model", "m", "--prompt", "x"])
    chosen = parser.parse_args(
        ["generate", "--model", "m", "--prompt", "x", "--scheduling-policy", "prefill_first"]
    )
    assert _engine_kwargs(default)["scheduling_policy"] == "mixed"
    assert _engine_kwargs(chosen)["scheduling_policy"] == "prefill_first"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--model", "m", "--scheduling-policy", "fifo"])
