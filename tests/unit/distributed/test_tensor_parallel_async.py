"""Async scheduling with ``tensor_parallel_size=2`` (CPU, gloo): the executor mirrors plans to
its worker and does not read carried tokens on its device, so the engine fills them in on
the host; outputs must equal the sync engine's (greedy and seeded; chunked prefill, prefix
hits, preemption, n > 1, stop ids)."""

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
    "num_kv_blocks": 10,
    "tensor_parallel_size": 2,
}


def test_tensor_parallel_async_equals_sync(make_checkpoint: Callable[..., Path]) -> None:
    checkpoint = make_checkpoint("tiny")
    rng = random.Random(0)
    shared = [rng.randrange(3, 250) for _ in range(20)]
    prompts = [
        (shared if index % 2 else []) + [rng.randrange(3, 250) for _ in range(rng.randint(5, 60))]
        for index in range(6)
    ]
    params = [
        SamplingParams(
            temperature=0.0 if index % 2 else 0.8,
            seed=index,
            max_tokens=24,
            n=2 if index == 3 else 1,
            stop_token_ids=rng.sample(range(3, 250), 20),
        )
        for index in range(6)
    ]
    outputs = {}
    for flag in (False, True):
        with Engine(checkpoint, async_scheduling=flag, **SETTINGS) as engine:
            assert engine.async_scheduling is flag
            finals = engine.generate(prompts, params, use_tqdm=False)
            outputs[flag] = [
                [(c.token_ids, c.finish_reason, c.stop_reason) for c in final.outputs]
                for final in finals
            ]
            if flag:
                assert engine.stats().num_preemptions > 0, "the test should preempt"
    assert outputs[True] == outputs[False]
