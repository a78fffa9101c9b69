"""RMSNorm, RoPE (every supported variant) and SwiGLU against transformers' implementations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from pagedinfer.adapters.layers.activation import SiluAndMul
from pagedinfer.adapters.layers.norm import RMSNorm
from pagedinfer.adapters.layers.rotary import RotaryEmbedding, apply_rotary
from pagedinfer.adapters.models.config import ModelConfig

CPU = torch.device("cpu")
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def _hf_rope_kwargs(rope_parameters: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5 reads ``rope_parameters``; 4.x (the lower bound, 4.56) reads
    ``rope_theta`` and ``rope_scaling`` and ignores the new key (make test-deps runs both)."""
    if TRANSFORMERS_5:
        return {"rope_parameters": dict(rope_parameters)}
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    legacy: dict[str, Any] = {"rope_theta": rope_parameters["rope_theta"]}
    if scaling.get("rope_type", "default") != "default":
        legacy["rope_scaling"] = scaling
    return legacy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_is_bit_identical(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 64, generator=generator) * 3).to(dtype)
    weight = torch.randn(64, generator=generator).to(dtype)
    ours = RMSNorm(64, eps=1e-5, dtype=dtype, device=torch.device("cpu"))
    theirs = Qwen3RMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        expected = theirs(x)
    result = ours(x)
    assert result.dtype == expected.dtype
    assert torch.equal(result, expected)


@pytest.mark.parametrize(("head_dim", "theta"), [(32, 10_000.0), (128, 1_000_000.0), (16, 500.0)])
def test_rope_matches_transformers(head_dim: int, theta: float) -> None:
    config = Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        **_hf_rope_kwargs({"rope_type": "default", "rope_theta": theta}),
    )
    generator = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 2, 17, 511, 4000, 3])
    q = torch.randn(len(positions), 4, head_dim, generator=generator)
    k = torch.randn(len(positions), 2, head_dim, generator=generator)
    cos_hf, sin_hf = Qwen3RotaryEmbedding(config)(q, positions[None, :])
    # transformers works on [batch, heads, tokens, dim].
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf
    )
    rope = RotaryEmbedding(head_dim, 4096, theta, device=CPU)
    cos, sin = rope(positions)
    torch.testing.assert_close(
        apply_rotary(q, cos, sin), q_hf[0].transpose(0, 1), rtol=0, atol=1e-6
    )
    torch.testing.assert_close(
        apply_rotary(k, cos, sin), k_hf[0].transpose(0, 1), rtol=0, atol=1e-6
    )


def test_rope_keeps_the_input_dtype() -> None:
    rope = RotaryEmbedding(8, 16, 10_000.0, device=CPU)
    cos, sin = rope(torch.tensor([3, 4]))
    x = torch.randn(2, 1, 8).to(torch.bfloat16)
    assert apply_rotary(x, cos, sin).dtype is torch.bfloat16
    assert rope.cos.dtype is torch.float32


def test_rope_position_zero_is_identity() -> None:
    rope = RotaryEmbedding(8, 16, 10_000.0, device=CPU)
    cos, sin = rope(torch.tensor([0]))
    x = torch.randn(1, 3, 8)
    assert torch.equal(apply_rotary(x, cos, sin), x)


def test_silu_and_mul_is_swiglu() -> None:
    x = torch.randn(5, 2 * 6)
    gate, up = x[:, :6], x[:, 6:]
    assert torch.equal(SiluAndMul()(x), torch.nn.functional.silu(gate) * up)


# ------------------------------------------------------------------ RoPE variants

ROPE_VARIANTS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn-mscale-no-truncate": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 256,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "truncate": False,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 1024,
        "attention_factor": 1.3,
    },
}


def _hf_rotary(head_dim: int, rope_parameters: dict[str, Any]) -> LlamaRotaryEmbedding:
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=2048,
        **_hf_rope_kwargs(rope_parameters),
    )
    return LlamaRotaryEmbedding(config)


def _ours(head_dim: int, rope_parameters: dict[str, Any], max_position: int) -> RotaryEmbedding:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "head_dim": head_dim,
        "max_position_embeddings": 2048,
        "rope_parameters": dict(rope_parameters),
    }
    config = ModelConfig.from_dict(raw, Path("rope-test"))
    return RotaryEmbedding(
        head_dim, max_position, config.rope_theta, config.rope_scaling, device=CPU
    )


@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_scaling_matches_transformers(variant: str, head_dim: int) -> None:
    params = {"rope_theta": 500_000.0, **ROPE_VARIANTS[variant]}
    positions = torch.tensor([0, 1, 5, 255, 256, 511, 1000, 2047])
    cos_hf, sin_hf = _hf_rotary(head_dim, params)(torch.zeros(1), positions[None, :])
    cos, sin = _ours(head_dim, params, 2048)(positions)
    half = head_dim // 2
    # Bit for bit. transformers' tables repeat each angle for both halves ([cos, cos]).
    assert torch.equal(cos[:, 0], cos_hf[0, :, :half])
    assert torch.equal(sin[:, 0], sin_hf[0, :, :half])


@pytest.mark.parametrize("head_dim", [32, 128])
def test_dynamic_ntk_rope_matches_transformers_generation(head_dim: int) -> None:
    """Position ``p`` is rotated as transformers rotates the newest token of a sequence of
    ``p + 1`` tokens (its decode step), also beyond max_position_embeddings."""
    params = {"rope_theta": 10_000.0, "rope_type": "dynamic", "factor": 2.0}
    ours = _ours(head_dim, params, 4096)
    for position in (0, 100, 2046, 2047, 2048, 2049, 3000, 4095):
        hf = _hf_rotary(head_dim, params)  # fresh: transformers caches its last frequencies
        cos_hf, sin_hf = hf(torch.zeros(1), torch.arange(position + 1)[None, :])
        cos, sin = ours(torch.tensor([position]))
        half = head_dim // 2
        assert torch.equal(cos[0, 0], cos_hf[0, -1, :half]), position  # bit for bit
        assert torch.equal(sin[0, 0], sin_hf[0, -1, :half]), position
    # Within the original context the table is the default one.
    default = _ours(head_dim, {"rope_theta": 10_000.0, "rope_type": "default"}, 2048)
    assert torch.equal(ours.cos[:2048], default.cos)
    assert not torch.allclose(ours.cos[2048:], _ours(head_dim, params, 4096).cos[:2048])
