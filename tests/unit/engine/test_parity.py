"""Greedy token-for-token parity with Hugging Face transformers on tiny random Qwen3 models.

Every configuration the engine can take to produce a token (prefix cache on/off, warm cache,
chunked prefill, forced preemption, block sizes) must give exactly transformers' tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hf_reference import hf_greedy
from pagedinfer import Engine, SamplingParams

MAX_TOKENS = 12


def _prompts(seed: int, count: int, vocab: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def _shared_prefix_prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(70)]
    return [system + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(6)]


def _check(engine: Engine, checkpoint: Path, prompts: list[list[int]]) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == hf_greedy(checkpoint, prompt, MAX_TOKENS), (
            f"mismatch for a prompt of {len(prompt)} tokens"
        )
        assert output.outputs[0].finish_reason == "length"
    return outputs


SHAPES = {
    "gqa-tied": {},
    "mha-untied": {"num_key_value_heads": 4, "tie_word_embeddings": False},
    "gqa4-theta1e6": {
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 1_000_000.0,
    },
    "wide-head": {
        "hidden_size": 48,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "tie_word_embeddings": False,
    },
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shapes_match_transformers(make_checkpoint: Callable[..., Path], shape: str) -> None:
    checkpoint = make_checkpoint("tiny", **SHAPES[shape])
    prompts = _prompts(1, 10, 512, (1, 90))
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=256) as engine:
        _check(engine, checkpoint, prompts)


@pytest.mark.parametrize("block_size", [16, 32, 256])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_block_sizes_and_prefix_cache(
    make_checkpoint: Callable[..., Path], block_size: int, prefix_caching: bool
) -> None:
    checkpoint = make_checkpoint("tiny")
    prompts = _shared_prefix_prompts(2, 512) + _prompts(3, 4, 512, (1, 40))
    with Engine(
        checkpoint,
        device="cpu",
        kv_block_size=block_size,
        max_model_len=512,
        enable_prefix_caching=prefix_caching,
    ) as engine:
        first = _check(engine, checkpoint, prompts)
        second = _check(engine, checkpoint, prompts)  # warm cache when caching is on
        if prefix_caching:
            # The first pass admits every prompt in one step, so nothing is cached yet; the
            # second pass finds every full prompt block (all but the last of each prompt).
            assert all(o.num_cached_tokens == 0 for o in first)
            cached = [o.num_cached_tokens for o in second]
            assert cached == [(len(p) - 1) // block_size * block_size for p in prompts]
            if block_size < 64:
                assert engine.stats().prefix_cache_hit_rate > 0
        if not prefix_caching:
            assert all(o.num_cached_tokens == 0 for o in first + second)


def test_chunked_prefill(make_checkpoint: Callable[..., Path]) -> None:
    checkpoint = make_checkpoint("tiny")
    prompts = _prompts(4, 6, 512, (30, 120))
    with Engine(
        checkpoint, device="cpu", kv_block_size=16, max_model_len=256, max_num_batched_tokens=24
    ) as engine:
        _check(engine, checkpoint, prompts)
        stats = engine.scheduler.stats()
        chunk_steps = stats.num_prefill_steps + stats.num_mixed_steps
        assert chunk_steps >= sum(map(len, prompts)) // 24


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forced_preemption(make_checkpoint: Callable[..., Path], prefix_caching: bool) -> None:
    checkpoint = make_checkpoint("tiny")
    # Prompts that end on a block boundary: five of them fill a 10-block pool at admission,
    # and the first decode step needs a new block for each, so someone must be preempted.
    prompts = [p[: 32 if i % 2 else 16] for i, p in enumerate(_prompts(5, 8, 512, (32, 32)))]
    with Engine(
        checkpoint,
        device="cpu",
        kv_block_size=16,
        max_model_len=128,
        num_kv_blocks=10,
        enable_prefix_caching=prefix_caching,
    ) as engine:
        _check(engine, checkpoint, prompts)
        assert engine.stats().num_preemptions > 0


def test_chunked_prefill_with_preemption_and_shared_prefixes(
    make_checkpoint: Callable[..., Path],
) -> None:
    checkpoint = make_checkpoint("tiny", num_key_value_heads=1)
    prompts = _shared_prefix_prompts(6, 512)
    with Engine(
        checkpoint,
        device="cpu",
        kv_block_size=16,
        max_model_len=128,
        num_kv_blocks=8,
        max_num_batched_tokens=40,
    ) as engine:
        _check(engine, checkpoint, prompts)
        _check(engine, checkpoint, list(reversed(prompts)))


def test_decode_in_length_groups(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch backend splits ragged decode batches into length groups; with the per-group
    cost set to zero it does so whenever that saves padding, and the tokens do not change."""
    from pagedinfer.adapters.attention import torch_ref

    splits: list[int] = []
    original = torch_ref.split_by_length

    def spy(lengths: list[int], overhead: int, max_groups: int = 4) -> list[list[int]] | None:
        groups = original(lengths, overhead, max_groups)
        splits.append(0 if groups is None else len(groups))
        return groups

    monkeypatch.setattr(torch_ref, "_GROUP_OVERHEAD_BYTES", 0)
    monkeypatch.setattr(torch_ref, "split_by_length", spy)
    checkpoint = make_checkpoint("tiny")
    prompts = _prompts(7, 12, 512, (1, 120))
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=256) as engine:
        _check(engine, checkpoint, prompts)
    assert max(splits) > 1, "the ragged batch was never split"
