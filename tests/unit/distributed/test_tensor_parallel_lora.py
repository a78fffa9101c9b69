"""LoRA with ``tensor_parallel_size=2`` (CPU, gloo): each rank holds its shard of every
adapter (B's rows for q/k/v and gate/up, A's columns for o and down, whose partial shrinks
are summed over the ranks); a batch mixing the base model and two adapters gives exactly
transformers' tokens with each adapter merged by PEFT, as one rank does."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedinfer import Engine, LoRARequest, SamplingParams
from peft_reference import ATTENTION, MLP, make_adapter, merged_greedy

pytestmark = [pytest.mark.tensor_parallel, pytest.mark.slow]


def test_two_ranks_serve_mixed_adapters_as_peft_merged(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    base = make_checkpoint("tiny")
    loras = [
        LoRARequest(
            "attn", 1, str(make_adapter(base, tmp_path / "a", ATTENTION, rank=8, alpha=16, seed=31))
        ),
        LoRARequest(
            "all",
            2,
            str(make_adapter(base, tmp_path / "b", ATTENTION + MLP, rank=4, alpha=8, seed=32)),
        ),
    ]
    rng = random.Random(4)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(3, 20))] for _ in range(6)]
    chosen = [None, loras[0], loras[1], loras[0], None, loras[1]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with Engine(
        base, device="cpu", tensor_parallel_size=2, kv_block_size=8, num_kv_blocks=64,
        max_model_len=64, enable_lora=True, max_loras=2,
    ) as engine:  # fmt: skip
        outputs = engine.generate(prompts, params, use_tqdm=False, lora_request=chosen)
    for lora in (None, *loras):
        rows = [i for i, chosen_lora in enumerate(chosen) if chosen_lora == lora]
        adapter = None if lora is None else Path(lora.lora_path)
        want = merged_greedy(base, adapter, [prompts[i] for i in rows], 6)
        assert [outputs[i].outputs[0].token_ids for i in rows] == want, lora
