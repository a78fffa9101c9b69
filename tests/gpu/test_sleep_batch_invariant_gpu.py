"""Sleep mode and batch-invariant outputs on a real GPU (issue 40; docs/sleep_mode.md).

Sleep: the memory ``sleep()`` frees goes back to the device (``torch.cuda.mem_get_info``
rises by most of the KV cache at level 1, by the weights too at level 2), and the outputs
after ``wake_up()`` are the ones before. Batch invariance: a request's greedy tokens and
logprobs alone and in a mixed, chunked batch are bitwise equal in bfloat16 on CUDA.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 512
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_the_memory_back_and_wake_up_the_outputs(
    make_checkpoint: Callable[..., Path], level: int
) -> None:
    checkpoint = make_checkpoint("tiny", hidden_size=256, intermediate_size=1024, vocab_size=4096)
    with Engine(
        checkpoint, kv_block_size=16, max_model_len=256, gpu_memory_utilization=0.3
    ) as engine:
        runner = engine._executor
        assert isinstance(runner, ModelRunner)
        kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
        before = [o.outputs[0].token_ids for o in engine.generate(prompts, PARAMS, use_tqdm=False)]
        awake = _free_bytes()
        engine.sleep(level=level)
        freed = _free_bytes() - awake
        # Both levels free the weights' device memory (level 1 keeps a host copy).
        assert freed >= 0.8 * (kv_bytes + weight_bytes), (freed, kv_bytes, weight_bytes)
        engine.wake_up()
        after = [o.outputs[0].token_ids for o in engine.generate(prompts, PARAMS, use_tqdm=False)]
        assert after == before


def test_batch_invariant_bfloat16_on_cuda(make_checkpoint: Callable[..., Path]) -> None:
    rng = random.Random(40)
    target = [rng.randrange(VOCAB) for _ in range(37)]
    others = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 60, 13, 90, 3, 41)]
    with Engine(
        make_checkpoint("tiny"),
        dtype="bfloat16",
        kv_block_size=16,
        max_model_len=256,
        max_num_batched_tokens=32,
        gpu_memory_utilization=0.3,
        batch_invariant=True,
    ) as engine:
        alone = engine.generate([target], PARAMS, use_tqdm=False)[0].outputs[0]
        engine.reset_prefix_cache()
        batch = [*others[:3], target, *others[3:]]
        mixed = engine.generate(batch, PARAMS, use_tqdm=False)[3].outputs[0]
    assert mixed.token_ids == alone.token_ids
    assert mixed.logprobs == alone.logprobs
