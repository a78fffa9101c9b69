"""The Triton kernels with an FP8 KV cache, against torch (CPU under ``TRITON_INTERPRET=1``).

The store kernels (store_kv, the fused q/k-norm + RoPE + store) quantize in integer ops
(``kernels/fp8.py``), so under the interpreter they run the very code a GPU runs; their bytes
must equal torch's ``quantize_fp8`` (the clamp, then ``.to(float8)``, round to nearest even)
bit for bit, on every rounding boundary of both formats. The attention kernels dequantize on
the fly; they must match a dense float64 reference over the dequantized K/V, and the torch
backend, on decode (with and without split-KV), prefill after a cached prefix and mixed steps.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_batches import PagedBatch, dense_reference, make_batch, tolerance

from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend, store_kv_torch
from pagedinfer.adapters.attention.triton import TritonAttentionBackend
from pagedinfer.adapters.kernels.decode_attention import paged_decode_attention
from pagedinfer.adapters.kernels.prefill_attention import PrefillTiles, paged_prefill_attention
from pagedinfer.adapters.kernels.qk_norm_rope import qk_norm_rope_store
from pagedinfer.adapters.kernels.store_kv import store_kv_cache
from pagedinfer.adapters.kv_cache import dequantize_fp8, quantize_fp8, scale_row
from pagedinfer.adapters.layers.rotary import RotaryEmbedding, qk_norm_rope_torch

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]


def scales(k_scale: float, v_scale: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(scale_row(k_scale, v_scale), dtype=torch.float32, device=device)


def boundary_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, every midpoint between neighbours (the ties), the
    floats just above and below each midpoint, values past the largest finite one, zeros and
    values far below the smallest subnormal; both signs."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)
    grid = grid[torch.isfinite(grid)].unique()
    grid = grid[grid >= 0]
    mids = (grid[1:] + grid[:-1]) / 2
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.full_like(mids, float("-inf")))
    largest = float(torch.finfo(dtype).max)
    extra = torch.tensor([largest * 1.01, largest * 1.2, 1e9, 1e-30, 0.0])
    values = torch.cat([grid, mids, up, down, extra])
    return torch.cat([values, -values])


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("k_scale", [0.25, 0.37], ids=["pow2", "arbitrary"])
def test_store_kernel_quantizes_bit_exactly_as_torch(
    cache_dtype: torch.dtype, k_scale: float, device: torch.device
) -> None:
    kv_heads, head_dim, block_size = 2, 16, 16
    values = boundary_values(cache_dtype) * k_scale  # the boundaries, after the scale
    per_token = kv_heads * head_dim
    num_tokens = -(-values.numel() // per_token)
    flat = torch.zeros(num_tokens * per_token)
    flat[: values.numel()] = values
    # K as a strided view (every other head of a wider tensor), V the boundaries reversed.
    wide = torch.zeros(num_tokens, 2 * kv_heads, head_dim)
    wide[:, ::2] = flat.view(num_tokens, kv_heads, head_dim)
    key = wide.to(device)[:, ::2]
    value = flat.flip(0).view(num_tokens, kv_heads, head_dim).to(device)
    num_blocks = -(-num_tokens // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(0))
    slots = slots[:num_tokens].clone()
    slots[[1, 5]] = -1  # padding rows: stored nowhere
    slots = slots.to(device)
    row = scales(k_scale, 2.0**-3, device)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    # The caches start as one recognisable byte (0x33) so untouched slots can be told apart.
    k_cache = torch.full(shape, 0x33, dtype=torch.uint8, device=device).view(cache_dtype)
    v_cache = k_cache.clone()
    k_expected, v_expected = k_cache.clone(), v_cache.clone()

    store_kv_cache(key, value, k_cache, v_cache, slots, kv_scales=row)
    store_kv_torch(key, value, k_expected, v_expected, slots, kv_scales=row)

    assert torch.equal(k_cache.view(torch.uint8), k_expected.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_expected.view(torch.uint8))
    # The reference itself: saturating (no inf, no NaN), and the padding rows went nowhere.
    stored = k_expected.to(torch.float32)
    assert torch.isfinite(stored).all()
    touched = (k_expected.view(torch.uint8) != 0x33).any(-1).any(-1).sum().item()
    assert touched <= num_tokens - 2


def test_the_interpreter_conversion_is_not_what_the_kernels_rely_on() -> None:
    """Why fp8.py quantizes in integer ops: torch rounds 1000 to e4m3's largest value 448 and
    ties to even; the quantizer must do the same (here, on the torch side)."""
    row = scales(1.0, 1.0, torch.device("cpu"))
    x = torch.tensor([1000.0, -1000.0, 0.0625 * 1.0625, 17.0])  # a tie: 16 and 18 -> 16
    stored = quantize_fp8(x, row[2], torch.float8_e4m3fn).to(torch.float32)
    assert stored.tolist() == [448.0, -448.0, 0.0625, 16.0]
    huge = quantize_fp8(torch.tensor([1e6]), row[2], torch.float8_e5m2).to(torch.float32)
    assert huge.item() == 57344.0  # saturated: a plain .to(float8_e5m2) would give inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
def test_fused_qk_norm_rope_store_quantizes_like_the_torch_path(
    dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device
) -> None:
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 32, 16, 3
    generator = torch.Generator().manual_seed(3)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(7, width, generator=generator) * 4).to(device, dtype)
    positions = torch.tensor([0, 1, 2, 3, 20, 21, 40], device=device)
    slots = torch.tensor([0, 1, 2, -1, 20, 21, 40], device=device)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, device=device)
    weights = torch.rand(2, head_dim, generator=generator) * 8 + 1
    q_weight, k_weight = weights.to(device, dtype)
    shape = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim}
    row = scales(2.0**-4, 0.3, device)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.zeros(cache_shape, dtype=cache_dtype, device=device)
    v_cache = torch.zeros(cache_shape, dtype=cache_dtype, device=device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()

    qk_norm_rope_store(
        qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache, slots,
        q_weight=q_weight, k_weight=k_weight, kv_scales=row, **shape,
    )  # fmt: skip
    cos, sin = rotary(positions)
    _, key, value = qk_norm_rope_torch(qkv, cos, sin, q_weight=q_weight, k_weight=k_weight, **shape)
    store_kv_torch(key, value, k_expected, v_expected, slots, kv_scales=row)

    # v is moved: the same bytes. k is computed in float32 in both, in a different order: a
    # value on a rounding boundary may land one step away, never more.
    assert torch.equal(v_cache.view(torch.uint8), v_expected.view(torch.uint8))
    k_bytes, expected_bytes = k_cache.view(torch.uint8), k_expected.view(torch.uint8)
    assert (k_bytes != expected_bytes).float().mean() <= 0.01
    got = dequantize_fp8(k_cache, row[0], torch.float32)
    want = dequantize_fp8(k_expected, row[0], torch.float32)
    torch.testing.assert_close(got, want, rtol=0.25, atol=2.0**-16)
    assert got.abs().max() > 1.0  # the layer's K really is in the cache


# ---------------------------------------------------------------------- attention


def fp8_batch(batch: PagedBatch, cache_dtype: torch.dtype, row: torch.Tensor) -> PagedBatch:
    """The batch with its caches quantized (unowned slots saturated: reading one shows) and
    its per-sequence K/V replaced by what the cache will hold (for the dense reference)."""

    def fake(x: torch.Tensor, which: int) -> torch.Tensor:
        stored = quantize_fp8(x, row[2 + which], cache_dtype)
        return dequantize_fp8(stored, row[which], x.dtype)

    junk = 1e6  # saturates to the format's largest value
    return dataclasses.replace(
        batch,
        k_cache=quantize_fp8(batch.k_cache.nan_to_num(junk), row[2], cache_dtype),
        v_cache=quantize_fp8(batch.v_cache.nan_to_num(junk), row[3], cache_dtype),
        keys=[fake(k, 0) for k in batch.keys],
        values=[fake(v, 1) for v in batch.values],
    )


def torch_backend_output(batch: PagedBatch, row: torch.Tensor) -> torch.Tensor:
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    return TorchAttentionBackend(batch.meta.block_size).forward(
        batch.query, batch.key, batch.value, k_cache, v_cache, batch.meta, batch.scale,
        kv_scales=row,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_dequantizes_on_the_fly(
    dtype: torch.dtype, cache_dtype: torch.dtype, num_splits: int, device: torch.device
) -> None:
    row = scales(2.0**-5, 0.37, device)
    batch = make_batch(
        [1, 1, 1], [70, 5, 33], block_size=16, num_heads=4, num_kv_heads=2, head_dim=32,
        dtype=dtype, device=device, is_prefill=False, seed=1,
    )  # fmt: skip
    batch = fp8_batch(batch, cache_dtype, row)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    store_kv_cache(batch.key, batch.value, k_cache, v_cache, batch.meta.slot_mapping, kv_scales=row)

    out = paged_decode_attention(
        batch.query, k_cache, v_cache, context_lens=batch.meta.context_lens,
        block_tables=batch.meta.block_tables, scale=batch.scale, num_splits=num_splits,
        kv_scales=row,
    )  # fmt: skip

    expected = dense_reference(batch)
    torch.testing.assert_close(out.double().cpu(), expected, **tolerance(dtype))
    torch.testing.assert_close(out, torch_backend_output(batch, row), **tolerance(dtype))


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
def test_prefill_kernel_dequantizes_the_cached_prefix_and_the_chunk(
    cache_dtype: torch.dtype, device: torch.device
) -> None:
    row = scales(0.3, 2.0**-4, device)
    # A fresh prompt, a chunk after a cached prefix, a one-token chunk.
    batch = make_batch(
        [20, 24, 1], [20, 90, 9], block_size=16, num_heads=4, num_kv_heads=2, head_dim=32,
        device=device, seed=2,
    )  # fmt: skip
    batch = fp8_batch(batch, cache_dtype, row)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    meta = batch.meta
    store_kv_cache(batch.key, batch.value, k_cache, v_cache, meta.slot_mapping, kv_scales=row)

    out = paged_prefill_attention(
        batch.query, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q,
        context_lens=meta.context_lens, block_tables=meta.block_tables,
        max_seqlen_q=meta.max_seqlen_q, scale=batch.scale, kv_scales=row,
        tiles=PrefillTiles(block_m=16, block_n=16, num_warps=4, num_stages=1),
    )  # fmt: skip

    torch.testing.assert_close(out.double().cpu(), dense_reference(batch), **tolerance(out.dtype))
    torch.testing.assert_close(out, torch_backend_output(batch, row), **tolerance(out.dtype))


@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
def test_a_mixed_step_through_the_triton_backend_matches_the_torch_backend(
    cache_dtype: torch.dtype, device: torch.device
) -> None:
    row = scales(2.0**-4, 2.0**-3, device)
    batch = make_batch(
        [1, 1, 12, 5], [40, 3, 12, 37], block_size=16, num_heads=4, num_kv_heads=2,
        head_dim=32, device=device, num_decode_rows=2, seed=3,
    )  # fmt: skip
    batch = fp8_batch(batch, cache_dtype, row)
    caches = batch.k_cache.clone(), batch.v_cache.clone()
    expected_caches = batch.k_cache.clone(), batch.v_cache.clone()

    out = TritonAttentionBackend(16).forward(
        batch.query, batch.key, batch.value, *caches, batch.meta, batch.scale, kv_scales=row
    )
    expected = TorchAttentionBackend(16).forward(
        batch.query, batch.key, batch.value, *expected_caches, batch.meta, batch.scale,
        kv_scales=row,
    )  # fmt: skip

    for got, want in zip(caches, expected_caches, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    torch.testing.assert_close(out.double(), dense_reference(batch), **tolerance(torch.float32))
