"""The prefill / extend kernel against a dense float64 reference and the torch backend."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from paged_batches import PagedBatch, dense_reference, make_batch, tolerance

from pagedinfer.adapters.kernels.prefill_attention import PrefillTiles, paged_prefill_attention
from pagedinfer.adapters.kernels.store_kv import store_kv_cache

SMALL_TILES = PrefillTiles(block_m=16, block_n=16, num_warps=1, num_stages=1)


@dataclass(frozen=True)
class Case:
    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    pending_tokens: int = 0


CASES = {
    # No cached prefix: the step's own K/V are the whole context.
    "fresh-block16-mha": Case([7, 33], [7, 33], 16, 2, 2, 32),
    "fresh-block32-gqa2-fp16": Case([40, 5, 70], [40, 5, 70], 32, 4, 2, 32, torch.float16),
    # Prefix-cache hits: contexts longer than the queries, crossing page boundaries.
    "prefix-block16-gqa4": Case([5, 17], [37, 50], 16, 8, 2, 16),
    "prefix-block48-gqa8-fp16": Case([1, 20], [97, 60], 48, 8, 1, 16, torch.float16),
    # A chunk in the middle of a long prompt (more prompt tokens follow it).
    "chunk-block64-dim24": Case([30, 16], [90, 16], 64, 4, 4, 24, pending_tokens=40),
    "mixed-block128-gqa4-fp16": Case([130, 1, 9], [130, 200, 140], 128, 4, 1, 32, torch.float16),
    "block256-dim40": Case([20, 300], [270, 300], 256, 2, 1, 40),
    # The head dims real Qwen3 models use.
    "prefix-block16-dim128-fp16": Case([3, 40], [50, 40], 16, 4, 2, 128, torch.float16),
    "chunk-block32-dim64": Case([24], [56], 32, 2, 1, 64, pending_tokens=9),
}


def build(case: Case, device: torch.device, seed: int = 0) -> PagedBatch:
    return make_batch(
        case.query_lens,
        case.context_lens,
        block_size=case.block_size,
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim,
        dtype=case.dtype,
        pending_tokens=case.pending_tokens,
        device=device,
        seed=seed,
    )


def run_kernel(batch: PagedBatch, tiles: PrefillTiles | None) -> torch.Tensor:
    meta = batch.meta
    store_kv_cache(batch.key, batch.value, batch.k_cache, batch.v_cache, meta.slot_mapping)
    return paged_prefill_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        cu_seqlens_q=meta.cu_seqlens_q,
        context_lens=meta.context_lens,
        block_tables=meta.block_tables,
        max_seqlen_q=meta.max_seqlen_q,
        scale=batch.scale,
        tiles=tiles,
    )


@pytest.mark.parametrize("tiles", [None, SMALL_TILES], ids=["default-tiles", "16x16-tiles"])
@pytest.mark.parametrize("name", list(CASES))
def test_prefill_matches_dense_reference_and_torch_backend(
    name: str, tiles: PrefillTiles | None, device: torch.device
) -> None:
    case = CASES[name]
    batch = build(case, device)
    expected = dense_reference(batch)
    oracle = batch.torch_backend_output()

    out = run_kernel(batch, tiles)

    assert out.dtype == case.dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.double().cpu(), expected, **tolerance(case.dtype))
    torch.testing.assert_close(out, oracle, **tolerance(case.dtype))


def test_every_query_row_depends_only_on_its_visible_keys(device: torch.device) -> None:
    # Changing the last key of a sequence must change only that sequence's last query row.
    case = CASES["prefix-block16-gqa4"]
    before = run_kernel(build(case, device), SMALL_TILES)
    batch = build(case, device)
    batch.key[batch.query_lens[0] - 1] += 1.0  # the last token of sequence 0
    after = run_kernel(batch, SMALL_TILES)

    changed = (before - after).abs().amax(dim=(1, 2)) > 0
    expected = torch.zeros_like(changed)
    expected[batch.query_lens[0] - 1] = True
    assert torch.equal(changed, expected)


def test_output_buffer_is_filled_in_place(device: torch.device) -> None:
    case = CASES["fresh-block16-mha"]
    batch = build(case, device)
    out = torch.full_like(batch.query, float("nan"))
    meta = batch.meta
    store_kv_cache(batch.key, batch.value, batch.k_cache, batch.v_cache, meta.slot_mapping)

    result = paged_prefill_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        cu_seqlens_q=meta.cu_seqlens_q,
        context_lens=meta.context_lens,
        block_tables=meta.block_tables,
        max_seqlen_q=meta.max_seqlen_q,
        scale=batch.scale,
        out=out,
    )

    assert result is out
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch), **tolerance(case.dtype))
