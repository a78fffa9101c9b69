"""Hybrid-attention checkpoints built with transformers' own config classes (and, where a
family has one, the config.json layout older transformers wrote), token for token against
transformers through the engine: chunked prefill, a warm prefix cache, prompts several
windows long. Each shape here was once read differently from transformers."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_reference import hf_greedy
from pagedinfer import Engine, SamplingParams

VOCAB = 256
MAX_TOKENS = 8
TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}


def build(
    directory: Path,
    model_class: str,
    config: Any,
    rewrite: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """A random checkpoint of transformers' ``model_class``; ``rewrite`` edits its
    config.json afterwards (transformers reads the edited file as the reference)."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():  # wide enough for clear greedy margins
            param.normal_(0.0, 0.1, generator=generator)
    model.save_pretrained(str(directory))
    if rewrite is not None:
        config_file = directory / "config.json"
        raw = json.loads(config_file.read_text())
        rewrite(raw)
        config_file.write_text(json.dumps(raw))
    return directory


def gemma3_as_transformers_4_wrote_it(raw: dict[str, Any]) -> None:
    """Gemma 3's config.json before transformers 5: no layer_types (sliding_window_pattern),
    rope_theta + rope_scaling for the global layers, rope_local_base_freq for the others."""
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        raw.pop(key, None)
    raw.update(
        sliding_window_pattern=3,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )


def make_gemma3_legacy(directory: Path) -> Path:
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**TINY, sliding_window=10, query_pre_attn_scalar=16)
    return build(directory, "Gemma3ForCausalLM", config, gemma3_as_transformers_4_wrote_it)


def make_qwen3_moe_sliding(directory: Path) -> Path:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        **TINY,
        use_sliding_window=True,
        sliding_window=12,
        max_window_layers=1,  # transformers' Qwen3-MoE slides every layer regardless
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    return build(directory, "Qwen3MoeForCausalLM", config)


def make_gemma3_multimodal(directory: Path) -> Path:
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(
        **{**TINY, "vocab_size": VOCAB + 4},
        sliding_window=8,
        sliding_window_pattern=3,
        query_pre_attn_scalar=16,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=VOCAB + 1,
        eoi_token_index=VOCAB + 2,
        image_token_index=VOCAB + 3,
    )
    return build(directory, "Gemma3ForConditionalGeneration", config)


MAKERS: dict[str, Callable[[Path], Path]] = {
    "gemma3-transformers-4-config": make_gemma3_legacy,
    "qwen3-moe-use-sliding-window": make_qwen3_moe_sliding,
    "gemma3-multimodal-text-tower": make_gemma3_multimodal,
}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name: str = request.param
    return MAKERS[name](tmp_path_factory.mktemp(name))


def test_matches_transformers_with_chunking_and_a_warm_prefix_cache(checkpoint: Path) -> None:
    rng = random.Random(4)
    shared = [rng.randrange(VOCAB) for _ in range(40)]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(n)] for n in (9, 33, 50)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with Engine(
        checkpoint, device="cpu", kv_block_size=16, max_model_len=128, max_num_batched_tokens=32
    ) as engine:
        first = engine.generate(prompts, params, use_tqdm=False)
        again = engine.generate(list(reversed(prompts)), params, use_tqdm=False)[::-1]
        assert engine.stats().prefix_cache_hit_rate > 0
    for prompt, output, warm in zip(prompts, first, again, strict=True):
        expected = hf_greedy(checkpoint, prompt, MAX_TOKENS)
        assert output.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert warm.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens, cached"
