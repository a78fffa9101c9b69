"""RMSNorm, RoPE and SwiGLU against transformers' Qwen3 implementations."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from pagedinfer.adapters.layers.activation import SiluAndMul
from pagedinfer.adapters.layers.norm import RMSNorm
from pagedinfer.adapters.layers.rotary import RotaryEmbedding, apply_rotary

CPU = torch.device("cpu")


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
        rope_parameters={"rope_type": "default", "rope_theta": theta},
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
