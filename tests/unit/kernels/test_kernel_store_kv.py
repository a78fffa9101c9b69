"""The store-KV kernel writes exactly the addressed slots, skipping slot -1."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.adapters.attention.torch_ref import store_kv_torch
from pagedinfer.adapters.kernels.store_kv import store_kv_cache


def caches(
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return (
        torch.full(shape, -7.0, dtype=dtype, device=device),
        torch.full(shape, -9.0, dtype=dtype, device=device),
    )


@pytest.mark.parametrize(
    ("block_size", "kv_heads", "head_dim", "dtype"),
    [
        (16, 2, 32, torch.float32),
        (16, 3, 24, torch.float16),  # head dim that is not a power of two
        (48, 1, 16, torch.float32),
        (32, 40, 128, torch.float16),  # more heads than one program copies
    ],
)
def test_store_matches_torch_reference_and_skips_negative_slots(
    block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    generator = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 6, 13
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[2, 7]] = -1
    key = torch.randn(num_tokens, kv_heads, head_dim, generator=generator).to(device, dtype)
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=generator).to(device, dtype)
    slots = slots.to(device)
    k_cache, v_cache = caches(num_blocks, block_size, kv_heads, head_dim, dtype, device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()

    store_kv_cache(key, value, k_cache, v_cache, slots)
    store_kv_torch(key, value, k_expected, v_expected, slots)

    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)
    flat_k = k_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[slots[0]], key[0])
    # Only the 11 real tokens' slots changed.
    assert (k_cache != -7.0).any(dim=(2, 3)).sum() == num_tokens - 2


def test_store_reads_strided_views_and_converts_dtype(device: torch.device) -> None:
    # K and V sliced out of a packed QKV projection (token stride > kv_heads * head_dim),
    # float32 values into a float16 cache.
    kv_heads, head_dim, num_tokens = 2, 16, 5
    packed = torch.randn(num_tokens, 4 * kv_heads * head_dim, device=device)
    key = packed[:, : kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    value = packed[:, 2 * kv_heads * head_dim : 3 * kv_heads * head_dim].view(
        num_tokens, kv_heads, head_dim
    )
    assert not key.is_contiguous()
    k_cache, v_cache = caches(2, 16, kv_heads, head_dim, torch.float16, device)
    slots = torch.tensor([3, 17, -1, 0, 31], device=device)

    store_kv_cache(key, value, k_cache, v_cache, slots)

    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[token].half())
            assert torch.equal(flat_v[slot], value[token].half())


def test_store_of_no_tokens_is_a_no_op(device: torch.device) -> None:
    k_cache, v_cache = caches(1, 16, 1, 16, torch.float32, device)
    empty = torch.empty(0, 1, 16, device=device)

    store_kv_cache(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=device))

    assert (k_cache == -7.0).all() and (v_cache == -9.0).all()
