"""Two gloo ranks on CPU produce exactly the single-process greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch.multiprocessing as mp

from pagedinfer.domain import SamplingParams

from ..runner_helpers import generate, make_runner, random_prompts
from .tp_worker import run_rank

MAX_TOKENS = 8


def test_two_ranks_match_one(tiny_checkpoint: Path, tmp_path: Path) -> None:
    prompts = random_prompts(seed=41, count=3, lengths=(3, 40))
    output = tmp_path / "rank0.json"
    mp.spawn(  # type: ignore[attr-defined,no-untyped-call]
        run_rank,
        args=(
            2,
            str(tmp_path / "rendezvous"),
            str(tiny_checkpoint),
            prompts,
            MAX_TOKENS,
            str(output),
        ),
        nprocs=2,
        join=True,
    )
    result = json.loads(output.read_text())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected, _ = generate(make_runner(tiny_checkpoint), prompts, params)
    assert result["tokens"] == expected
    # Both ranks sized the same pool: 8 sequences x 128 tokens / 16 per block.
    assert result["num_kv_blocks"] == 8 * 8
