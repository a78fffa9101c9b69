"""Speculative decoding (n-gram) with ``tensor_parallel_size=2`` (CPU, gloo): the executor
mirrors each plan, verify rows included, to its worker, and the worker's shard must verify
the same drafts; greedy and seeded outputs must equal ``tensor_parallel_size=1`` without
speculation, with drafts accepted (else the test would prove little)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import Engine, SamplingParams

pytestmark = [pytest.mark.tensor_parallel, pytest.mark.slow]

SETTINGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "max_model_len": 128,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 48,
    "num_kv_blocks": 9,
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def test_tensor_parallel_ngram_equals_one_rank_without_speculation(
    make_checkpoint: Callable[..., Path],
) -> None:
    checkpoint = make_checkpoint("tiny")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(5, 60))] for _ in range(6)]
    params = [
        SamplingParams(
            temperature=0.0 if index % 2 else 0.8,
            seed=10 + index,
            max_tokens=28,
            ignore_eos=True,
            n=2 if index == 3 else 1,
        )
        for index in range(6)
    ]
    outputs = {}
    for tp, speculative in ((1, None), (2, NGRAM)):
        with Engine(
            checkpoint, tensor_parallel_size=tp, speculative_config=speculative, **SETTINGS
        ) as engine:
            finals = engine.generate(prompts, params, use_tqdm=False)
            stats = engine.stats()
        outputs[tp] = [[(c.token_ids, c.finish_reason) for c in final.outputs] for final in finals]
    assert stats.num_preemptions > 0, "the test should preempt"
    assert stats.spec_decode_num_accepted_tokens > 0, "no draft was accepted: a weak test"
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens
    assert outputs[2] == outputs[1]
