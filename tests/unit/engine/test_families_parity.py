"""Every model family, token for token against transformers through the whole engine.

Each shape runs the workload that exercises everything the engine can do to a sequence at
once (tests/unit/engine/test_parity.py covers each feature alone on Qwen3): prompts sharing a
70-token prefix, a pool too small for all of them (preemption and recomputation), a step
budget smaller than a prompt (chunked prefill), then the same prompts again in reverse order
on the warm prefix cache. Greedy float32 tokens must equal transformers' ``generate``.
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
VOCAB = 512
LLAMA = {"architecture": "LlamaForCausalLM"}
MISTRAL = {"architecture": "MistralForCausalLM"}
QWEN2 = {"architecture": "Qwen2ForCausalLM"}
QWEN3_MOE = {"architecture": "Qwen3MoeForCausalLM"}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

SHAPES: dict[str, dict[str, Any]] = {
    # Llama 3.1-style: GQA, untied head, llama3 RoPE; with both kinds of bias.
    "llama3.1-gqa-untied-biases": {
        **LLAMA,
        "rope_theta": 500_000.0,
        "rope_scaling": LLAMA3_ROPE,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "mlp_bias": True,
    },
    # Llama 3.2 1B-style: tied embeddings, llama3 RoPE, GQA 8/2 with small heads.
    "llama3.2-tied-gqa4": {
        **LLAMA,
        "rope_theta": 500_000.0,
        "rope_scaling": LLAMA3_ROPE,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
    "llama2-mha-linear-rope": {
        **LLAMA,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
    "llama-yarn-rope": {
        **LLAMA,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2-gqa-tied": {**QWEN2},
    "qwen2-mha-untied": {**QWEN2, "num_key_value_heads": 4, "tie_word_embeddings": False},
    # A window at least max_model_len long is plain causal attention.
    "mistral-gqa-window": {**MISTRAL, "sliding_window": 128, "tie_word_embeddings": False},
    "mistral-mha-no-window": {**MISTRAL, "num_key_value_heads": 4},
    "qwen3-moe-top2-normalized": {**QWEN3_MOE},
    "qwen3-moe-mixed-layers-top3": {
        **QWEN3_MOE,
        "num_hidden_layers": 3,
        "mlp_only_layers": (1,),
        "num_experts_per_tok": 3,
        "norm_topk_prob": False,
        "tie_word_embeddings": False,
        "num_key_value_heads": 1,
    },
}


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(70)]
    return [system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(6)]


def check(engine: Engine, checkpoint: Path, prompts: list[list[int]], max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(checkpoint, prompt, max_tokens)
        assert output.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_family_matches_transformers_under_caching_chunking_and_preemption(
    make_checkpoint: Callable[..., Path], shape: str
) -> None:
    checkpoint = make_checkpoint("tiny", **SHAPES[shape])
    prompts = shared_prefix_prompts(6)
    with Engine(
        checkpoint,
        device="cpu",
        kv_block_size=16,
        max_model_len=128,
        num_kv_blocks=8,
        max_num_batched_tokens=40,
    ) as engine:
        check(engine, checkpoint, prompts, MAX_TOKENS)
        check(engine, checkpoint, list(reversed(prompts)), MAX_TOKENS)
        stats = engine.stats()
        assert stats.num_preemptions > 0
        assert stats.prefix_cache_hit_rate > 0
        assert engine.scheduler.stats().num_prefill_steps > 2 * len(prompts)  # chunked


def test_dynamic_rope_generates_past_the_trained_context(
    make_checkpoint: Callable[..., Path],
) -> None:
    """Dynamic NTK stretches a 64-position model to 128: prompts inside the trained context,
    generation well past it, as transformers rotates each new token."""
    checkpoint = make_checkpoint(
        "tiny",
        **LLAMA,
        max_position_embeddings=64,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    rng = random.Random(8)
    # Shorter than 63 tokens: transformers only resets its grown frequencies for prompts
    # shorter than the trained context.
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 62))] for _ in range(4)]
    with Engine(checkpoint, device="cpu", kv_block_size=16) as engine:  # the model's limit
        assert engine.max_model_len == 128
        check(engine, checkpoint, prompts, 50)
