"""Tensor parallelism (TP=2, gloo on the CPU) for the Llama, Qwen3-MoE and GPT-OSS families.

Llama: heads, KV heads, MLP and vocabulary split, with every kind of bias (a row-parallel
bias is added once) and llama3 RoPE. Qwen3-MoE: each expert's intermediate features split
across the ranks (every rank holds a slice of every expert, so all ranks do the same work
whatever the routing), the router replicated, dense and sparse layers mixed. Both under
chunked prefill, prefix-cache hits and preemption, token for token against transformers.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hf_reference import hf_greedy
from pagedinfer import Engine, SamplingParams
from pagedinfer.errors import ConfigurationError

from .tp_helpers import shared_prefix_prompts

pytestmark = [pytest.mark.tensor_parallel, pytest.mark.slow]

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SETTINGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "max_model_len": 128,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 48,
    "num_kv_blocks": 12,
    "enable_prefix_caching": True,
}
# GPT-OSS holds a table per KV group (full and sliding) and the null block: more blocks.
FAMILY_SETTINGS: dict[str, dict[str, Any]] = {"gpt-oss-sinks-window": {"num_kv_blocks": 20}}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama-biases-llama3-rope": {
        "architecture": "LlamaForCausalLM",
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": False,
        "rope_theta": 500_000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    # Sinks split by heads, sliding (8) and full layers, each expert's interleaved gate/up
    # columns split by whole pairs, the down bias added once.
    "gpt-oss-sinks-window": {
        "architecture": "GptOssForCausalLM",
        "layer_types": ("sliding_attention", "full_attention"),
        "sliding_window": 8,
        "attention_bias": True,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "tie_word_embeddings": False,
    },
    "qwen3-moe-mixed-layers": {
        "architecture": "Qwen3MoeForCausalLM",
        "num_hidden_layers": 3,
        "mlp_only_layers": (1,),
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tp2_matches_transformers(make_checkpoint: Callable[..., Path], family: str) -> None:
    checkpoint = make_checkpoint("tiny", **FAMILIES[family])
    prompts = shared_prefix_prompts(seed=31, count=6)
    assert max(len(prompt) for prompt in prompts) > SETTINGS["max_num_batched_tokens"]
    settings = {**SETTINGS, **FAMILY_SETTINGS.get(family, {})}
    with Engine(checkpoint, tensor_parallel_size=2, **settings) as engine:
        outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
        again = engine.generate(prompts[:2], GREEDY, use_tqdm=False)  # warm prefix cache
        stats = engine.stats()
        preemptions = stats.num_preemptions
        windows = [group.window for group in stats.kv_groups]
    # Both ranks group GPT-OSS's layers by window (rank 0's groups reach the scheduler).
    assert windows == ([None, 8] if family == "gpt-oss-sinks-window" else [])
    for prompt, output in zip([*prompts, *prompts[:2]], [*outputs, *again], strict=True):
        assert output.outputs[0].token_ids == hf_greedy(checkpoint, prompt, MAX_TOKENS)
    assert preemptions > 0
    assert all(output.num_cached_tokens >= 32 for output in again)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"architecture": "Qwen3MoeForCausalLM", "moe_intermediate_size": 33}, "moe_intermediate"),
    ],
)
def test_refused_before_any_worker_starts(
    make_checkpoint: Callable[..., Path], overrides: dict[str, Any], fragment: str
) -> None:
    checkpoint = make_checkpoint("tiny", **overrides)
    before = set(multiprocessing.active_children())
    with pytest.raises(ConfigurationError, match=fragment):
        Engine(checkpoint, tensor_parallel_size=2, **SETTINGS)
    assert set(multiprocessing.active_children()) == before
