"""Speculative decoding on a real GPU (issue 26): the Triton path's verify rows (prefill
kernel over a cached context) and draft steps (decode kernel), with the same tokens as decoding
without speculation. float32, so greedy tokens must be identical; seeded rows too (the
verification reuses the non-speculative noise). Run with ``make test-gpu``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer import Engine, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

OPTIONS: dict[str, Any] = {
    "device": "cuda",
    "dtype": "float32",
    "kv_block_size": 16,
    "max_model_len": 256,
    "num_kv_blocks": 64,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 16,
}


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(512) for _ in range(40)]
    return [system + [rng.randrange(512) for _ in range(rng.randint(1, 30))] for _ in range(8)]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0.0 if index % 2 else 0.8,
            seed=100 + index,
            max_tokens=40,
            ignore_eos=True,
            presence_penalty=0.4 if index % 3 == 0 else 0.0,
        )
        for index in range(8)
    ]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_equals_plain_on_cuda(
    make_checkpoint: Callable[..., Path], method: str
) -> None:
    checkpoint = make_checkpoint("tiny")
    prompts, params = _prompts(), _params()
    with Engine(checkpoint, **OPTIONS) as plain:
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, False)]
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        config["model"] = str(checkpoint)  # the target as its own draft: greedy rows accept
    with Engine(checkpoint, speculative_config=config, **OPTIONS) as engine:
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, params, False)]
        stats = engine.stats()
    assert got == expected
    assert stats.spec_decode_num_accepted_tokens > 0
