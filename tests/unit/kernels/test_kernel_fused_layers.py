"""The fused layer kernels against their torch twins (the layers' own arithmetic).

residual-add + RMSNorm, per-head q/k RMSNorm + RoPE (with and without the KV store) and
SiLU-and-mul, in float32 and float16 (the interpreter's bf16 is not trustworthy), on tiny
shapes including head dims and hidden sizes that are not powers of two and strided inputs.
"""

from __future__ import annotations

import pytest
import torch

from pagedinfer.adapters.attention.torch_ref import store_kv_torch
from pagedinfer.adapters.kernels.add_rms_norm import add_rms_norm, rms_norm
from pagedinfer.adapters.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_store
from pagedinfer.adapters.kernels.silu_and_mul import silu_and_mul
from pagedinfer.adapters.layers.activation import SiluAndMul, silu_and_mul_torch
from pagedinfer.adapters.layers.norm import RMSNorm, add_rms_norm_torch, rms_norm_torch
from pagedinfer.adapters.layers.rotary import RotaryEmbedding, qk_norm_rope_torch

DTYPES = [torch.float32, torch.float16]
# float32: only the order of the float32 sums differs. float16: that difference can move a
# rounding of the normalised value by one unit in the last place.
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


def randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(device, dtype)


# ------------------------------------------------------------------- add + RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rms_norm_matches_the_twin(
    dtype: torch.dtype, hidden: int, device: torch.device
) -> None:
    x = randn(5, hidden, dtype=dtype, device=device, seed=0)
    residual = randn(5, hidden, dtype=dtype, device=device, seed=1)
    weight = randn(hidden, dtype=dtype, device=device, seed=2)
    x_before, residual_before = x.clone(), residual.clone()

    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_summed = add_rms_norm_torch(x, residual, weight, 1e-6)

    assert torch.equal(summed, expected_summed)  # one rounding of the same sum
    torch.testing.assert_close(normed, expected_normed, **TOLERANCE[dtype])
    assert normed.dtype == summed.dtype == dtype
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_rows_matches_the_layer(
    dtype: torch.dtype, device: torch.device
) -> None:
    wide = randn(4, 3 * 48, dtype=dtype, device=device, seed=3)
    x = wide[:, 48:96]  # rows strided like a slice of a packed projection
    layer = RMSNorm(48, eps=1e-5, dtype=dtype, device=device)
    layer.weight.copy_(randn(48, dtype=dtype, device=device, seed=4))
    fused = RMSNorm(48, eps=1e-5, dtype=dtype, device=device, fused=True)
    fused.weight.copy_(layer.weight)

    torch.testing.assert_close(rms_norm(x, layer.weight, 1e-5), layer(x), **TOLERANCE[dtype])
    torch.testing.assert_close(fused(x), rms_norm_torch(x, layer.weight, 1e-5), **TOLERANCE[dtype])
    residual = randn(4, 48, dtype=dtype, device=device, seed=5)
    fused_out = fused.add_and_norm(x, residual)
    torch_out = layer.add_and_norm(x, residual)
    torch.testing.assert_close(fused_out[0], torch_out[0], **TOLERANCE[dtype])
    assert torch.equal(fused_out[1], torch_out[1])


def test_rms_norm_of_no_rows(device: torch.device) -> None:
    x = torch.empty(0, 32, device=device)
    weight = torch.ones(32, device=device)
    assert rms_norm(x, weight, 1e-6).shape == (0, 32)
    normed, summed = add_rms_norm(x, x, weight, 1e-6)
    assert normed.shape == summed.shape == (0, 32)


# ------------------------------------------------------------------------ SiLU-and-mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 40, 1500])  # 1500: more than one block per row
def test_silu_and_mul_matches_the_twin(
    dtype: torch.dtype, width: int, device: torch.device
) -> None:
    x = randn(3, 2 * width, dtype=dtype, device=device, seed=6)
    out = silu_and_mul(x)
    assert out.shape == (3, width) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_torch(x), **TOLERANCE[dtype])
    torch.testing.assert_close(SiluAndMul(fused=True)(x), SiluAndMul()(x), **TOLERANCE[dtype])


# ------------------------------------------------------------ q/k RMSNorm + RoPE (+ store)

SHAPES = [
    # heads, kv heads, head dim
    (4, 2, 32),
    (3, 1, 24),  # half head dim not a power of two, odd GQA ratio
    (40, 8, 64),  # more q heads than one program handles
]


def _qkv(
    num_tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    width = (heads + 2 * kv_heads) * head_dim
    padded = randn(num_tokens, width + 8, dtype=dtype, device=device, seed=7)
    return padded[:, :width]  # strided rows, like a view of a larger buffer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("with_norm", [True, False], ids=["qk-norm", "rope-only"])
def test_qk_norm_rope_matches_the_layers(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    with_norm: bool,
    device: torch.device,
) -> None:
    num_tokens = 6
    qkv = _qkv(num_tokens, heads, kv_heads, head_dim, dtype, device)
    positions = torch.tensor([0, 1, 2, 7, 100, 511], device=device)
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, device=device)
    q_weight = randn(head_dim, dtype=dtype, device=device, seed=8) if with_norm else None
    k_weight = randn(head_dim, dtype=dtype, device=device, seed=9) if with_norm else None
    shape = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim}

    q, k = qk_norm_rope(
        qkv, positions, rotary.cos, rotary.sin, q_weight=q_weight, k_weight=k_weight, **shape
    )
    cos, sin = rotary(positions)
    expected_q, expected_k, _ = qk_norm_rope_torch(
        qkv, cos, sin, q_weight=q_weight, k_weight=k_weight, **shape
    )

    torch.testing.assert_close(q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k, expected_k, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES[:2])
def test_qk_norm_rope_store_writes_the_cache_and_skips_padding(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, device: torch.device
) -> None:
    num_tokens, num_blocks, block_size = 5, 4, 16
    qkv = _qkv(num_tokens, heads, kv_heads, head_dim, dtype, device)
    positions = torch.tensor([3, 4, 5, 40, 41], device=device)
    slots = torch.tensor([3, 4, -1, 63, 17], device=device)
    rotary = RotaryEmbedding(head_dim, 64, 1_000_000.0, device=device)
    q_weight = randn(head_dim, dtype=dtype, device=device, seed=10)
    k_weight = randn(head_dim, dtype=dtype, device=device, seed=11)
    shape = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim}
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(cache_shape, -7.0, dtype=dtype, device=device)
    v_cache = torch.full(cache_shape, -9.0, dtype=dtype, device=device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()

    q = qk_norm_rope_store(
        qkv,
        positions,
        rotary.cos,
        rotary.sin,
        k_cache,
        v_cache,
        slots,
        q_weight=q_weight,
        k_weight=k_weight,
        **shape,
    )
    cos, sin = rotary(positions)
    expected_q, expected_k, expected_v = qk_norm_rope_torch(
        qkv, cos, sin, q_weight=q_weight, k_weight=k_weight, **shape
    )
    store_kv_torch(expected_k, expected_v, k_expected, v_expected, slots)

    torch.testing.assert_close(q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k_cache, k_expected, **TOLERANCE[dtype])
    assert torch.equal(v_cache, v_expected)  # v is moved, not computed
    # Exactly the four real slots changed; the padding row's (slot -1) K/V went nowhere.
    changed = (k_cache != -7.0).flatten(2).any(-1).flatten()
    assert changed.nonzero().flatten().tolist() == [3, 4, 17, 63]
