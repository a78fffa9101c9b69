"""The CPU (torch) attention path's shortcuts give the same numbers as the plain twins."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend
from pagedinfer.adapters.layers.attention import PagedAttention
from pagedinfer.adapters.layers.norm import rms_norm_torch
from pagedinfer.adapters.layers.rotary import RotaryEmbedding, apply_rotary, qk_norm_rotate

HEADS, KV_HEADS, DIM = 4, 2, 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 200])  # 200: one part at a time
def test_q_and_k_normalised_and_rotated_together_are_bitwise_one_part_at_a_time(
    dtype: torch.dtype, num_tokens: int
) -> None:
    generator = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=generator).to(dtype)
    q_weight = (torch.rand(DIM, generator=generator) + 0.5).to(dtype)
    k_weight = (torch.rand(DIM, generator=generator) + 0.5).to(dtype)
    rotary = RotaryEmbedding(DIM, 512, 10000.0, device=torch.device("cpu"))
    positions = torch.randint(0, 512, (num_tokens,), generator=generator)
    cos, sin = rotary(positions)
    step = rotary.step(positions, fused=False)
    assert step.cos is not None and step.sin is not None
    query, key, value = qk_norm_rotate(
        qkv, step.cos, step.sin, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
        q_weight=q_weight, k_weight=k_weight,
    )  # fmt: skip
    q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    q = rms_norm_torch(q.reshape(num_tokens, HEADS, DIM), q_weight, 1e-6)
    k = rms_norm_torch(k.reshape(num_tokens, KV_HEADS, DIM), k_weight, 1e-6)
    assert torch.equal(query, apply_rotary(q, cos, sin))
    assert torch.equal(key, apply_rotary(k, cos, sin))
    assert torch.equal(value, v.reshape(num_tokens, KV_HEADS, DIM))


def test_the_stacked_norm_weight_follows_writes_to_the_norm_weights() -> None:
    layer = PagedAttention(HEADS, KV_HEADS, DIM, scale=1.0, backend=TorchAttentionBackend(16))
    q_weight, k_weight = torch.ones(DIM), torch.full((DIM,), 2.0)
    first = layer._stacked_qk_weight(q_weight, k_weight)
    assert layer._stacked_qk_weight(q_weight, k_weight) is first  # built once
    assert torch.equal(first[:HEADS], torch.ones(HEADS, DIM))
    assert torch.equal(first[HEADS:], torch.full((KV_HEADS, DIM), 2.0))
    k_weight.copy_(torch.full((DIM,), 3.0))  # a weight loaded again in place
    assert torch.equal(layer._stacked_qk_weight(q_weight, k_weight)[HEADS:], k_weight.expand(2, -1))
