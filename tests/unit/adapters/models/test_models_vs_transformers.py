"""Forward logits of every model family against transformers on the same checkpoint.

One varlen batch of several prompts goes through our model; each prompt goes through
transformers alone. Every position's logits must agree (float32).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_reference import hf_model
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.domain import SamplingParams, Scheduler, SchedulerConfig, Sequence

from ..runner_helpers import make_runner, random_prompts

LLAMA = {"architecture": "LlamaForCausalLM"}
QWEN2 = {"architecture": "Qwen2ForCausalLM"}
MISTRAL = {"architecture": "MistralForCausalLM"}
QWEN3_MOE = {"architecture": "Qwen3MoeForCausalLM"}

# Every family in several shapes: GQA and MHA, tied and untied, biases, RoPE variants, and for
# the MoE which layers are sparse and how the router weighs its experts.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-gqa-tied": {},
    "qwen3-mha-untied": {"num_key_value_heads": 4, "tie_word_embeddings": False},
    "qwen3-gqa4-small-head-theta1e6": {
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 1_000_000.0,
    },
    "qwen3-head-dim-not-hidden-over-heads": {
        "hidden_size": 48,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "tie_word_embeddings": False,
    },
    "qwen3-attention-bias-3-layers": {"attention_bias": True, "num_hidden_layers": 3},
    "llama-gqa-untied-biases": {
        **LLAMA,
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": False,
    },
    "llama-mha-tied": {**LLAMA, "num_key_value_heads": 4},
    "llama3-rope": {
        **LLAMA,
        "rope_theta": 500_000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "llama-linear-rope": {**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "llama-yarn-rope": {
        **LLAMA,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    },
    "qwen2-gqa-untied": {**QWEN2, "tie_word_embeddings": False},
    "qwen2-mha-tied": {**QWEN2, "num_key_value_heads": 4},
    "mistral-gqa-window": {**MISTRAL, "sliding_window": 4096, "tie_word_embeddings": False},
    "qwen3-moe-top2-normalized": {**QWEN3_MOE},
    "qwen3-moe-dense-layer-top3-raw": {
        **QWEN3_MOE,
        "num_hidden_layers": 3,
        "mlp_only_layers": (1,),
        "num_experts_per_tok": 3,
        "norm_topk_prob": False,
        "tie_word_embeddings": False,
    },
    "qwen3-moe-sparse-step-2-mha": {
        **QWEN3_MOE,
        "decoder_sparse_step": 2,
        "num_key_value_heads": 4,
        "num_experts": 4,
    },
}


def prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Our logits for every position of every prompt, prefilled together in one step."""
    config = runner.config
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=runner.num_kv_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
        )
    )
    for index, prompt in enumerate(prompts):
        scheduler.add(Sequence(index, prompt, SamplingParams(temperature=0.0)))
    plan = scheduler.schedule()
    assert plan is not None and plan.num_seqs == len(prompts)
    inputs = runner.prepare(plan)
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = runner.model.compute_logits(hidden)
    assert logits is not None
    cu = plan.cu_seqlens_q
    return [logits[cu[i] : cu[i + 1]] for i in range(len(prompts))]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_prefill_logits_match(make_checkpoint: Callable[..., Path], shape: str) -> None:
    path = make_checkpoint("tiny", **SHAPES[shape])
    prompts = random_prompts(seed=3, count=4, lengths=(1, 70))
    runner = make_runner(path)
    ours = prefill_logits(runner, prompts)
    reference = hf_model(str(path))
    for prompt, logits in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_decode_with_cached_prefix_matches(tiny_checkpoint: Path) -> None:
    """Logits of a decode step that attends over pages written by an earlier prefill."""
    prompt = random_prompts(seed=4, count=1, lengths=(40, 40))[0]
    runner = make_runner(tiny_checkpoint, block_size=16)
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=16, max_model_len=128)
    )
    seq = Sequence(0, prompt, SamplingParams(temperature=0.0, max_tokens=4))
    scheduler.add(seq)
    reference = hf_model(str(tiny_checkpoint))
    for _ in range(3):
        plan = scheduler.schedule()
        assert plan is not None
        inputs = runner.prepare(plan)
        with torch.inference_mode():
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
            logits = runner.model.compute_logits(hidden[-1:])
            expected = reference(torch.tensor([seq.token_ids])).logits[0, -1:]
        assert logits is not None
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        scheduler.postprocess(plan, [int(logits.argmax())])
    assert seq.num_completion_tokens == 3


def test_bfloat16_model_stays_close_to_float32(tiny_checkpoint: Path) -> None:
    prompts = random_prompts(seed=5, count=2, lengths=(10, 30))
    full = prefill_logits(make_runner(tiny_checkpoint), prompts)
    half = prefill_logits(make_runner(tiny_checkpoint, dtype=torch.bfloat16), prompts)
    for expected, logits in zip(full, half, strict=True):
        assert logits.dtype is torch.bfloat16
        torch.testing.assert_close(logits.float(), expected, rtol=0.05, atol=0.15)
