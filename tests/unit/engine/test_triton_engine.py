"""The Engine end to end on the Triton backend, run by Triton's CPU interpreter.

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` when CUDA is absent, so CI runs the same
store-KV, varlen-prefill and split-KV decode kernels the GPU runs, through the whole engine:
prefill, decode steps, chunked prefill and prefix-cache hits must give transformers' greedy
tokens. The interpreter is slow, so the model, the prompts and the outputs are small.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from hf_reference import hf_greedy
from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.kernels.moe import fused_moe
from pagedinfer.adapters.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton backend on the CPU needs TRITON_INTERPRET=1 (set by tests/conftest.py "
    "when CUDA is absent)",
)

BLOCK_SIZE = 16
MAX_BATCHED = 32
MAX_TOKENS = 4


def _prompts() -> list[list[int]]:
    """Two prompts sharing three full blocks (both longer than a step), and a short one."""
    rng = random.Random(0)
    shared = [rng.randrange(512) for _ in range(3 * BLOCK_SIZE)]
    return [
        [*shared, 11, 12, 13],
        [*shared, 21],
        [rng.randrange(512) for _ in range(5)],
    ]


def test_triton_engine_matches_transformers(make_checkpoint: Callable[..., Path]) -> None:
    checkpoint = make_checkpoint("tiny")
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [hf_greedy(checkpoint, prompt, MAX_TOKENS) for prompt in prompts]
    with Engine(
        checkpoint,
        device="cpu",
        attention_backend="triton",
        kv_block_size=BLOCK_SIZE,
        max_model_len=128,
        max_num_batched_tokens=MAX_BATCHED,
        num_kv_blocks=32,
    ) as engine:
        assert engine.attention_backend == "triton"

        cold = engine.generate(prompts, params, use_tqdm=False)
        cold_stats = engine.scheduler.stats()
        warm = engine.generate(prompts, params, use_tqdm=False)

    assert [o.outputs[0].token_ids for o in cold] == expected
    assert [o.outputs[0].token_ids for o in warm] == expected
    # The 51-token prompt cannot be prefilled in one 32-token step: chunked prefill, some
    # chunks beside the decode rows of the prompts already done (mixed steps).
    chunk_steps = cold_stats.num_prefill_steps + cold_stats.num_mixed_steps
    assert len(prompts[0]) > MAX_BATCHED and chunk_steps >= 3
    assert cold_stats.num_mixed_steps >= 1
    # The second prompt is admitted after the first one's first chunk stored two shared
    # blocks, so even the cold pass hits the prefix cache; the warm pass reads every full
    # prompt block from it.
    assert cold[1].num_cached_tokens > 0
    assert [o.num_cached_tokens for o in warm] == [48, 48, 0]


def test_moe_engine_on_the_triton_path_matches_transformers(
    make_checkpoint: Callable[..., Path],
) -> None:
    """Qwen3-MoE through the fused MoE kernel (the Triton path's experts) and the attention
    kernels, prefix cache and chunked prefill included."""
    checkpoint = make_checkpoint(
        "tiny", architecture="Qwen3MoeForCausalLM", num_experts=4, mlp_only_layers=(1,)
    )
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [hf_greedy(checkpoint, prompt, MAX_TOKENS) for prompt in prompts]
    with Engine(
        checkpoint,
        device="cpu",
        attention_backend="triton",
        kv_block_size=BLOCK_SIZE,
        max_model_len=128,
        max_num_batched_tokens=MAX_BATCHED,
        num_kv_blocks=32,
    ) as engine:
        cold = engine.generate(prompts, params, use_tqdm=False)
        warm = engine.generate(prompts, params, use_tqdm=False)
        runner = engine._executor
        assert isinstance(runner, ModelRunner)
        assert runner.model.get_submodule("model.layers.0.mlp").run_experts is fused_moe
    assert [o.outputs[0].token_ids for o in cold] == expected
    assert [o.outputs[0].token_ids for o in warm] == expected


def test_speculative_verify_rows_on_the_triton_path(make_checkpoint: Callable[..., Path]) -> None:
    """Speculative decoding's verify rows (a few query tokens over a cached context) through
    the varlen prefill kernel, and the draft model's one-token steps through the decode
    kernel: the target as its own draft gives transformers' greedy tokens, drafts accepted."""
    checkpoint = make_checkpoint("tiny")
    prompts = _prompts()[1:]
    max_tokens = 8
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    expected = [hf_greedy(checkpoint, prompt, max_tokens) for prompt in prompts]
    config = {"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 3}
    with Engine(
        checkpoint,
        device="cpu",
        attention_backend="triton",
        kv_block_size=BLOCK_SIZE,
        max_model_len=128,
        max_num_batched_tokens=MAX_BATCHED,
        num_kv_blocks=32,
        speculative_config=config,
    ) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.stats()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.spec_decode_num_accepted_tokens >= stats.spec_decode_num_draft_tokens // 2 > 0
