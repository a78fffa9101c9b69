"""The fused layer kernels compiled for a real GPU, at Qwen3-0.6B's sizes, in bf16 and fp16.

Oracle: the torch twins on the same inputs (the twins run the same roundings in the same
dtype, so only the float32 reduction order and the GPU's exp/rsqrt differ). Also: the kernels
inside a captured CUDA graph. Run with ``make test-gpu``.
"""

from __future__ import annotations

import pytest
import torch

from pagedinfer.adapters.attention.torch_ref import store_kv_torch
from pagedinfer.adapters.layers.activation import silu_and_mul_torch
from pagedinfer.adapters.layers.norm import add_rms_norm_torch, rms_norm_torch
from pagedinfer.adapters.layers.rotary import RotaryEmbedding, qk_norm_rope_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 1024, 3072, 16, 8, 128
DTYPES = [torch.bfloat16, torch.float16]
TOLERANCE = {
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
}
CUDA = torch.device("cuda")


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(*shape, generator=generator, device=CUDA).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 256, 4097])
def test_add_rms_norm_and_silu_at_model_size(dtype: torch.dtype, num_tokens: int) -> None:
    from pagedinfer.adapters.kernels.add_rms_norm import add_rms_norm, rms_norm
    from pagedinfer.adapters.kernels.silu_and_mul import silu_and_mul

    x = randn(num_tokens, HIDDEN, dtype=dtype, seed=0)
    residual = randn(num_tokens, HIDDEN, dtype=dtype, seed=1)
    weight = randn(HIDDEN, dtype=dtype, seed=2)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_summed = add_rms_norm_torch(x, residual, weight, 1e-6)
    assert torch.equal(summed, expected_summed)
    torch.testing.assert_close(normed, expected_normed, **TOLERANCE[dtype])
    # One rounding of the output dtype apart at most (the float32 reduction order differs).
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-6), rms_norm_torch(x, weight, 1e-6), **TOLERANCE[dtype]
    )

    gate_up = randn(num_tokens, 2 * INTERMEDIATE, dtype=dtype, seed=3)
    torch.testing.assert_close(
        silu_and_mul(gate_up), silu_and_mul_torch(gate_up), **TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 256, 4097])
def test_qk_norm_rope_store_at_model_size(dtype: torch.dtype, num_tokens: int) -> None:
    from pagedinfer.adapters.kernels.qk_norm_rope import qk_norm_rope_store

    block_size, num_blocks = 256, 24
    qkv = randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype, seed=4)
    positions = torch.randint(0, 40960, (num_tokens,), device=CUDA)
    slots = torch.randperm(num_blocks * block_size, device=CUDA)[:num_tokens]
    slots[::7] = -1
    rotary = RotaryEmbedding(HEAD_DIM, 40960, 1_000_000.0, device=CUDA)
    q_weight, k_weight = randn(HEAD_DIM, dtype=dtype, seed=5), randn(HEAD_DIM, dtype=dtype, seed=6)
    shape = {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    cache_shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    k_cache = torch.zeros(cache_shape, dtype=dtype, device=CUDA)
    v_cache = torch.zeros(cache_shape, dtype=dtype, device=CUDA)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()

    q = qk_norm_rope_store(
        qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache, slots,
        q_weight=q_weight, k_weight=k_weight, **shape,
    )  # fmt: skip
    cos, sin = rotary(positions)
    expected_q, expected_k, expected_v = qk_norm_rope_torch(
        qkv, cos, sin, q_weight=q_weight, k_weight=k_weight, **shape
    )
    store_kv_torch(expected_k, expected_v, k_expected, v_expected, slots)
    torch.testing.assert_close(q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k_cache, k_expected, **TOLERANCE[dtype])
    assert torch.equal(v_cache, v_expected)


def test_fused_kernels_replay_in_a_cuda_graph() -> None:
    from pagedinfer.adapters.kernels.add_rms_norm import add_rms_norm
    from pagedinfer.adapters.kernels.silu_and_mul import silu_and_mul

    dtype = torch.bfloat16
    x = randn(64, HIDDEN, dtype=dtype, seed=7)
    residual = randn(64, HIDDEN, dtype=dtype, seed=8)
    weight = randn(HIDDEN, dtype=dtype, seed=9)
    gate_up = randn(64, 2 * HIDDEN, dtype=dtype, seed=10)
    add_rms_norm(x, residual, weight, 1e-6)  # compile outside the capture
    silu_and_mul(gate_up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, summed = add_rms_norm(x, residual, weight, 1e-6)
        gated = silu_and_mul(gate_up)
    for seed in (11, 12):
        x.copy_(randn(64, HIDDEN, dtype=dtype, seed=seed))
        gate_up.copy_(randn(64, 2 * HIDDEN, dtype=dtype, seed=seed + 10))
        graph.replay()
        expected_normed, expected_summed = add_rms_norm_torch(x, residual, weight, 1e-6)
        assert torch.equal(summed, expected_summed)
        torch.testing.assert_close(normed, expected_normed, **TOLERANCE[dtype])
        torch.testing.assert_close(gated, silu_and_mul_torch(gate_up), **TOLERANCE[dtype])
