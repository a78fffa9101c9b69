"""config.json files that leave fields to transformers' per-family defaults, or that spell
each layer's attention the way older transformers did, read as transformers 5 reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.errors import UnsupportedModelError

BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
}


def read(tmp_path: Path, architecture: str, **fields: Any) -> ModelConfig:
    raw = {**BASE, "architectures": [architecture], **fields}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_pretrained(tmp_path)


def test_gemma3_as_transformers_4_wrote_it(tmp_path: Path) -> None:
    """Gemma 3 1B/4B's config.json: sliding_window_pattern, rope_local_base_freq and the
    global layers' rope_scaling (linear 8 on 4B+), no layer_types."""
    config = read(
        tmp_path,
        "Gemma3ForCausalLM",
        sliding_window=512,
        sliding_window_pattern=3,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    assert config.layer_windows == (512, 512, None) * 2
    assert (config.rope_theta, config.rope_scaling.rope_type) == (1_000_000.0, "linear")
    assert config.rope_scaling.factor == 8.0
    assert config.local_rope is not None
    assert (config.local_rope[0], config.local_rope[1].rope_type) == (10_000.0, "default")


def test_gemma3_defaults(tmp_path: Path) -> None:
    config = read(tmp_path, "Gemma3ForCausalLM", num_hidden_layers=7)
    # Gemma3TextConfig: pattern 6, window 4096, head_dim and query_pre_attn_scalar 256,
    # RoPE bases 1e6 (global) and 1e4 (local), tied, GELU-tanh gate.
    assert config.layer_windows == (4096,) * 5 + (None, 4096)
    assert (config.head_dim, config.attention_scale) == (256, 256**-0.5)
    assert config.rope_theta == 1_000_000.0
    assert config.local_rope is not None and config.local_rope[0] == 10_000.0
    assert config.tie_word_embeddings and config.hidden_act == "gelu_pytorch_tanh"


def test_gemma3_rope_parameters_without_a_sliding_entry(tmp_path: Path) -> None:
    config = read(
        tmp_path,
        "Gemma3ForCausalLM",
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5}},
    )
    assert config.rope_theta == 5e5
    assert config.local_rope is not None and config.local_rope[0] == 10_000.0


def test_gemma3_flat_rope_parameters_are_not_applied(tmp_path: Path) -> None:
    """Gemma3TextConfig(rope_parameters={flat}) saves the flat keys beside both kinds'
    entries, and its layers read only those entries."""
    config = read(
        tmp_path,
        "Gemma3ForCausalLM",
        rope_parameters={
            "rope_type": "linear",
            "factor": 8.0,
            "rope_theta": 5e5,
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    assert (config.rope_theta, config.rope_scaling.rope_type) == (1e6, "default")
    assert config.local_rope is not None and config.local_rope[0] == 1e4


def test_gemma3_yarn_truncates_as_transformers_does(tmp_path: Path) -> None:
    """transformers' YaRN reads `truncate` from the top level of rope_parameters, so a
    kind's own `truncate: false` is not applied."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    config = read(
        tmp_path,
        "Gemma3ForCausalLM",
        rope_parameters={
            "full_attention": {**yarn, "truncate": False},
            "sliding_attention": {**yarn, "truncate": False},
        },
    )
    assert config.rope_scaling.truncate
    assert config.local_rope is not None and config.local_rope[1].truncate


def test_gemma3_bidirectional_attention_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        read(tmp_path, "Gemma3ForCausalLM", use_bidirectional_attention=True)


def test_gpt_oss_defaults(tmp_path: Path) -> None:
    config = read(tmp_path, "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2)
    assert config.layer_windows == (128, None) * 3
    assert config.attention_bias and config.head_dim == 64
    assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 7.0)
    assert config.rope_theta == 150_000.0
    assert config.rope_scaling.rope_type == "yarn" and config.rope_scaling.factor == 32.0
    assert not config.rope_scaling.truncate


@pytest.mark.parametrize(
    ("fields", "windows"),
    [
        ({}, (4096,) * 6),  # MistralConfig's default window
        ({"sliding_window": None}, ()),
        # transformers' Mistral ignores layer_types: every layer slides
        ({"sliding_window": 8, "layer_types": ["full_attention"] * 6}, (8,) * 6),
    ],
)
def test_mistral_window(
    tmp_path: Path, fields: dict[str, Any], windows: tuple[int | None, ...]
) -> None:
    assert read(tmp_path, "MistralForCausalLM", **fields).layer_windows == windows


def test_qwen3_moe_slides_every_layer(tmp_path: Path) -> None:
    """transformers' Qwen3-MoE ignores max_window_layers: with use_sliding_window every
    layer slides."""
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    config = read(
        tmp_path,
        "Qwen3MoeForCausalLM",
        use_sliding_window=True,
        sliding_window=12,
        max_window_layers=2,
        **moe,
    )
    assert config.layer_windows == (12,) * 6


def test_llama_never_slides(tmp_path: Path) -> None:
    config = read(tmp_path, "LlamaForCausalLM", sliding_window=8)
    assert config.layer_windows == ()


def test_gemma3_conditional_generation_serves_its_text_tower(tmp_path: Path) -> None:
    text = {**BASE, "model_type": "gemma3_text", "sliding_window": 16, "head_dim": 16}
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32},
        "dtype": "bfloat16",
        "eos_token_id": [1, 106],
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.architecture == "Gemma3ForCausalLM"
    assert config.layer_windows == (16,) * 5 + (None,)
    assert config.head_dim == 16 and config.eos_token_ids == (1, 106)
    assert str(config.dtype) == "torch.bfloat16"


def test_gemma3_4b_text_config_names_only_what_differs(tmp_path: Path) -> None:
    """google/gemma-3-4b-it's config.json: its text_config leaves the rest to
    Gemma3TextConfig's defaults."""
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106],
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "torch_dtype": "bfloat16",
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.vocab_size, config.num_attention_heads, config.num_key_value_heads) == (
        262_208,
        8,
        4,
    )
    assert (config.head_dim, config.attention_scale) == (256, 256**-0.5)
    assert config.layer_windows == ((1024,) * 5 + (None,)) * 5 + (1024,) * 4
    assert (config.rope_theta, config.rope_scaling.rope_type) == (1_000_000.0, "linear")
    assert config.local_rope is not None and config.local_rope[0] == 10_000.0
    assert config.tie_word_embeddings and config.eos_token_ids == (1, 106)
