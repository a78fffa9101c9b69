"""Sliding-window and hybrid-attention models, token for token against transformers.

Windows of 8-16 tokens with 16-token blocks, on prompts several windows long that share a
70-token prefix, through the workload of test_families_parity: a pool too small for every
prompt (preemption and recomputation), a step budget smaller than a prompt (chunked prefill),
then the prompts again in reverse order on the warm prefix cache. Greedy float32 tokens must
equal transformers' ``generate``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hf_reference import hf_greedy
from pagedinfer import Engine, SamplingParams

MAX_TOKENS = 12
VOCAB = 256

SHAPES: dict[str, dict[str, Any]] = {
    # Every layer slides (Mistral's window); the prompts are 6-12 windows long.
    "mistral-window-12": {
        "architecture": "MistralForCausalLM",
        "sliding_window": 12,
        "vocab_size": VOCAB,
    },
    # Gemma 3: two sliding layers (window 8, local RoPE base) to one global (another base),
    # GELU gate, (1 + w) norms, query_pre_attn_scalar, capped final logits, untied head.
    "gemma3-local-global": {
        "architecture": "Gemma3ForCausalLM",
        "num_hidden_layers": 3,
        "layer_types": ("sliding_attention", "sliding_attention", "full_attention"),
        "sliding_window": 8,
        "rope_theta": 1_000_000.0,
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 5.0,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB,
    },
    # GPT-OSS: sinks in every layer, sliding (8) then full layers, YaRN RoPE, biased
    # attention, the biased router over 4 clamped-SwiGLU experts (top 2).
    "gpt-oss-sinks-moe": {
        "architecture": "GptOssForCausalLM",
        "layer_types": ("sliding_attention", "full_attention"),
        "sliding_window": 8,
        "attention_bias": True,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB,
    },
}


# A pool small enough to preempt. Hybrid models hold a table per KV group and the null block:
# one 128-token sequence needs 17 blocks with a full and a sliding group (GPT-OSS), 25 with
# a full and two sliding groups (this Gemma 3).
NUM_KV_BLOCKS = {"gemma3-local-global": 25, "gpt-oss-sinks-moe": 20}


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(70)]
    return [system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(5)]


def check(engine: Engine, checkpoint: Path, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(checkpoint, prompt, MAX_TOKENS)
        assert output.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_windowed_model_matches_transformers_under_caching_chunking_and_preemption(
    make_checkpoint: Callable[..., Path], shape: str
) -> None:
    checkpoint = make_checkpoint("tiny", **SHAPES[shape])
    prompts = shared_prefix_prompts(6)
    with Engine(
        checkpoint,
        device="cpu",
        kv_block_size=16,
        max_model_len=128,
        num_kv_blocks=NUM_KV_BLOCKS.get(shape, 8),
        max_num_batched_tokens=40,
    ) as engine:
        check(engine, checkpoint, prompts)
        check(engine, checkpoint, list(reversed(prompts)))
        stats = engine.stats()
        assert stats.num_preemptions > 0
        assert stats.prefix_cache_hit_rate > 0
        scheduled = engine.scheduler.stats()
        chunk_steps = scheduled.num_prefill_steps + scheduled.num_mixed_steps
        assert chunk_steps > 2 * len(prompts)  # chunked


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton backend on the CPU needs TRITON_INTERPRET=1 (set by tests/conftest.py "
    "when CUDA is absent)",
)
def test_the_triton_path_matches_transformers(make_checkpoint: Callable[..., Path]) -> None:
    """The fused RoPE + store kernel, then the window and the sinks in the prefill and decode
    kernels, through the engine (Triton's interpreter), on GPT-OSS."""
    checkpoint = make_checkpoint("tiny", **SHAPES["gpt-oss-sinks-moe"])
    rng = random.Random(3)
    shared = [rng.randrange(VOCAB) for _ in range(32)]
    prompts = [[*shared, 7, 8, 9], [*shared, 5]]  # the second hits the first's cached blocks
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with Engine(
        checkpoint,
        device="cpu",
        attention_backend="triton",
        kv_block_size=16,
        max_model_len=128,
        max_num_batched_tokens=32,
        num_kv_blocks=16,
    ) as engine:
        outputs = [engine.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(checkpoint, prompt, 3)
    assert outputs[1].num_cached_tokens >= 32
