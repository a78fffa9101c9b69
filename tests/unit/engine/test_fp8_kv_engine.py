"""``Engine(kv_cache_dtype="fp8")``: the capacity it reports, and the features that must work
unchanged on an FP8 cache (issue 25, item 1).

The quantization is deterministic (a value's bytes depend on the value and its layer's scale,
never on the step that stored it), so an FP8 engine under pressure (prefix hits, preemption
and recompute, chunked prefill in mixed steps, n>1 forks that copy blocks) must give exactly
the tokens of an FP8 engine that runs the same prompts in one relaxed batch. TP=2 against
TP=1 is in ``tests/unit/distributed/test_tensor_parallel_fp8_kv.py``; the accuracy against
a float32 cache in ``tests/unit/adapters/test_fp8_kv_accuracy.py``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.kv_cache import kv_block_bytes

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BASE: dict[str, Any] = {"device": "cpu", "kv_block_size": 16, "max_model_len": 128}


def _prompts(seed: int) -> list[list[int]]:
    """Two unrelated prompts, then five sharing a 40-token prefix (two whole blocks and a
    partial one): the prefix's blocks are the last freed, still cached for a second run."""
    rng = random.Random(seed)
    prefix = [rng.randrange(512) for _ in range(40)]
    shared = [prefix + [rng.randrange(512) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    return [[rng.randrange(512) for _ in range(rng.randint(10, 60))] for _ in range(2)] + shared


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_the_same_memory_holds_four_times_the_blocks_of_a_float32_cache(
    tiny_checkpoint: Path, name: str
) -> None:
    float32_block = kv_block_bytes(
        num_layers=2, block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.float32
    )
    memory = 10 * float32_block
    counts = {}
    for dtype in ("auto", name):
        with Engine(
            tiny_checkpoint, kv_cache_memory_bytes=memory, kv_cache_dtype=dtype, **BASE
        ) as engine:
            counts[dtype] = engine.stats().num_kv_blocks
            line = engine.describe()
    assert counts == {"auto": 10, name: 40}
    stored = "float8_e4m3fn" if name == "fp8" else "float8_e5m2"
    assert f"40 KV blocks of 16 tokens ({stored})" in line, line


def test_prefix_hits_preemption_mixed_steps_and_forks_keep_the_fp8_tokens(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = _prompts(3)
    with Engine(
        tiny_checkpoint, kv_cache_dtype="fp8", enable_prefix_caching=False, **BASE
    ) as engine:
        expected = [
            o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)
        ]

    from pagedinfer.adapters.model_runner import ModelRunner

    copied: list[tuple[tuple[int, int], ...]] = []
    original_copy = ModelRunner._copy_blocks

    def spy(self: ModelRunner, copies: tuple[tuple[int, int], ...]) -> None:
        copied.append(copies)
        original_copy(self, copies)

    monkeypatch.setattr(ModelRunner, "_copy_blocks", spy)
    forks = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=2)
    with Engine(
        tiny_checkpoint,
        kv_cache_dtype="fp8",
        num_kv_blocks=9,
        max_num_seqs=4,
        max_num_batched_tokens=40,
        **BASE,
    ) as engine:
        params = [forks if i % 3 == 2 else GREEDY for i in range(len(prompts))]
        outputs = engine.generate(prompts, params, use_tqdm=False)
        again = engine.generate(prompts[-3:], GREEDY, use_tqdm=False)  # warm prefix cache
        stats, scheduler = engine.stats(), engine.scheduler.stats()

    assert stats.num_preemptions > 0 and scheduler.num_mixed_steps > 0 and copied
    assert all(o.num_cached_tokens >= 32 for o in again)
    for output, tokens in zip(outputs, expected, strict=True):
        assert [c.token_ids for c in output.outputs] == [tokens] * len(output.outputs)
    assert [o.outputs[0].token_ids for o in again] == expected[-3:]
