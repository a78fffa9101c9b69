"""The torch backend's decode: length groups cut padding and never change the result."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_batches import dense_reference, make_batch, tolerance

from pagedinfer.adapters.attention import torch_ref
from pagedinfer.adapters.attention.base import AttentionMetadata
from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend, split_by_length

# Very different lengths in a scrambled order: sorting and grouping them matters.
RAGGED = [300, 3, 64, 5, 200, 17, 150, 1, 90, 260, 2, 33]


class TestSplitByLength:
    def test_similar_lengths_stay_one_group(self) -> None:
        assert split_by_length([100, 101, 99, 100], overhead=16) is None

    def test_one_group_when_the_overhead_outweighs_the_padding_saved(self) -> None:
        assert split_by_length([1, 1, 1, 100], overhead=10_000) is None

    def test_ragged_lengths_are_split_into_sorted_groups(self) -> None:
        groups = split_by_length(RAGGED, overhead=0)
        assert groups is not None and 2 <= len(groups) <= 4
        ordered = [RAGGED[row] for rows in groups for row in rows]
        assert ordered == sorted(RAGGED)

    @settings(max_examples=200, deadline=None)
    @given(
        lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=300),
        overhead=st.integers(0, 5000),
        max_groups=st.integers(1, 8),
    )
    def test_groups_partition_the_rows_and_never_cost_more(
        self, lengths: list[int], overhead: int, max_groups: int
    ) -> None:
        groups = split_by_length(lengths, overhead=overhead, max_groups=max_groups)
        single = len(lengths) * max(lengths) + overhead
        if groups is None:
            return
        assert 2 <= len(groups) <= max_groups
        assert sorted(row for rows in groups for row in rows) == list(range(len(lengths)))
        assert all(rows for rows in groups)
        cost = sum(len(rows) * max(lengths[r] for r in rows) + overhead for rows in groups)
        assert cost < single


def _decode(
    context_lens: list[int], overhead_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(backend output, dense reference, number of groups used) for one decode step."""
    monkeypatch.setattr(torch_ref, "_GROUP_OVERHEAD_BYTES", overhead_bytes)
    batch = make_batch(
        [1] * len(context_lens),
        context_lens,
        block_size=16,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        is_prefill=False,
        device=torch.device("cpu"),
    )
    k_cache, v_cache = batch.clean_caches()
    backend = TorchAttentionBackend(16)
    out = backend.forward(
        batch.query, batch.key, batch.value, k_cache, v_cache, batch.meta, batch.scale
    )
    # A second layer of the same step reuses the groups derived by the first.
    groups = batch.meta.derived["torch.decode_groups"]
    again = backend.forward(
        batch.query, batch.key, batch.value, k_cache, v_cache, batch.meta, batch.scale
    )
    assert batch.meta.derived["torch.decode_groups"] is groups
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    assert isinstance(groups, list)
    return out, dense_reference(batch), len(groups)


def test_grouped_decode_matches_the_dense_reference_and_the_single_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grouped, expected, num_groups = _decode(RAGGED, 0, monkeypatch)
    single, _, one = _decode(RAGGED, 1 << 40, monkeypatch)
    assert num_groups > 1 and one == 1
    torch.testing.assert_close(grouped.double(), expected, **tolerance(torch.float32))
    torch.testing.assert_close(single.double(), expected, **tolerance(torch.float32))
    # Only the padded length differs, which moves SDPA's blocking: rounding-level changes.
    torch.testing.assert_close(grouped, single, rtol=1e-5, atol=1e-6)


def test_a_large_batch_is_gathered_in_cache_sized_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    # One K+V row of this batch is 2 * 2 heads * 16 dims * 4 bytes = 256 bytes: a bound of
    # 300 rows' worth cuts the 12 ragged rows into groups of at most 300 padded positions.
    monkeypatch.setattr(torch_ref, "_GROUP_GATHER_BYTES", 300 * 256)
    bounded, expected, num_groups = _decode(RAGGED, 1 << 40, monkeypatch)
    assert num_groups >= 6  # every group but those of the shortest rows holds one or two
    torch.testing.assert_close(bounded.double(), expected, **tolerance(torch.float32))


def test_bounded_groups_keep_every_row_once() -> None:
    lengths = [500, 20, 300, 10]
    groups = torch_ref._bounded([[0, 1, 2, 3]], lengths, max_tokens=1000)
    assert groups == [[0, 1], [2, 3]]  # 2 x 500 and 2 x 300 padded positions
    assert torch_ref._bounded([[0, 1, 2, 3]], lengths, max_tokens=2000) is None
    assert torch_ref._bounded([[3, 1], [2, 0]], lengths, max_tokens=400) == [[3, 1], [2], [0]]


def _single_sequence_decode(
    blocks: list[int], length: int
) -> tuple[torch.Tensor, torch_ref._DecodeGroup]:
    """One sequence's decode step over the pages ``blocks`` (the same contents wherever
    they lie): (output, its decode group)."""
    block_size, kv_heads, heads, dim = 16, 2, 4, 8
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(length, kv_heads, dim, generator=generator)
    values = torch.randn(length, kv_heads, dim, generator=generator)
    query = torch.randn(1, heads, dim, generator=generator)
    k_cache = torch.zeros(8, block_size, kv_heads, dim)
    v_cache = torch.zeros(8, block_size, kv_heads, dim)
    for position in range(length - 1):  # the last token is stored by the step itself
        page, offset = blocks[position // block_size], position % block_size
        k_cache[page, offset], v_cache[page, offset] = keys[position], values[position]
    last = length - 1
    meta = AttentionMetadata(
        is_prefill=False,
        block_size=block_size,
        slot_mapping=torch.tensor([blocks[last // block_size] * block_size + last % block_size]),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, length], dtype=torch.int32),
        context_lens=torch.tensor([length], dtype=torch.int32),
        block_tables=torch.tensor([blocks], dtype=torch.int32),
        max_seqlen_q=1,
        max_seqlen_k=length,
        has_cached_prefix=True,
        query_lens_host=[1],
        context_lens_host=[length],
    )
    out = TorchAttentionBackend(block_size).forward(
        query, keys[last:], values[last:], k_cache, v_cache, meta, dim**-0.5
    )
    groups = meta.derived["torch.decode_groups"]
    assert isinstance(groups, list) and len(groups) == 1
    return out, groups[0]


def test_a_sequence_in_adjacent_pages_attends_over_a_view_with_the_same_result() -> None:
    adjacent, view_group = _single_sequence_decode([3, 4, 5], 40)
    scattered, gather_group = _single_sequence_decode([6, 1, 4], 40)
    assert view_group.first_slot == 3 * 16 and view_group.mask is None
    assert gather_group.first_slot is None and gather_group.mask is None
    torch.testing.assert_close(adjacent, scattered, rtol=0, atol=0)
