"""DecodeBatch: persistent decode rows, moved on in bulk, always equal to a rebuild."""

from __future__ import annotations

from array import array

import pytest

from pagedinfer.domain import BLOCK_TABLE_FILLER, PADDING_SLOT, DecodeBatch, Sequence
from pagedinfer.domain.decode_batch import _add_lanes, _pack

BLOCK = 4


def decoding(seq_id: int, num_tokens: int, table: list[int], slot: int = -1) -> Sequence:
    """A sequence whose every token but the last is computed."""
    seq = Sequence(seq_id, [100 * seq_id + i for i in range(num_tokens)])
    seq.block_table = list(table)
    seq.decoding = True
    seq.slot = seq_id if slot < 0 else slot
    return seq


def rows() -> list[Sequence]:
    # Next positions: 5 (in block 9 of [3, 9]), 2 (in block 7), 8 (first slot of block 5).
    return [decoding(0, 6, [3, 9]), decoding(1, 3, [7]), decoding(2, 9, [1, 2, 5])]


def test_adding_lanes_adds_to_every_entry_at_once() -> None:
    values = array("q", [0, 5, 2**40, 7])
    assert _add_lanes(values, _pack(array("q", [1, 1, 1, 1]))).tolist() == [1, 6, 2**40 + 1, 8]
    assert _add_lanes(values, _pack(array("q", [0, 1, 2, 3]))).tolist() == [0, 6, 2**40 + 2, 10]
    small = array("i", [2**31 - 2, 0, 9])
    assert _add_lanes(small, _pack(array("i", [1, 1, 1]))).tolist() == [2**31 - 1, 1, 10]
    assert _add_lanes(array("q"), 0).tolist() == []
    assert _add_lanes(values, 0) is not values  # a new array; plans may hold the old one


def test_rebuild_lays_out_one_row_per_sequence() -> None:
    batch = DecodeBatch(BLOCK)
    a, b, c = rows()
    batch.rebuild([a, b, c])
    assert len(batch) == 3
    assert batch.seq_ids.tolist() == [0, 1, 2]
    assert batch.sample_slots.tolist() == [0, 1, 2]
    assert batch.input_ids.tolist() == [5, 102, 208]
    assert batch.positions.tolist() == [5, 2, 8]
    assert batch.context_lens.tolist() == [6, 3, 9]
    assert batch.cu_seqlens_k.tolist() == [0, 6, 9, 18]
    assert batch.max_context_len == 9
    assert batch.slot_mapping.tolist() == [9 * BLOCK + 1, 7 * BLOCK + 2, 5 * BLOCK + 0]
    assert batch.width == 3
    assert batch.block_tables.tolist() == [3, 9, 0, 7, 0, 0, 1, 2, 5]
    batch.check()


def test_a_row_without_the_block_of_its_next_token_gets_the_padding_slot() -> None:
    batch = DecodeBatch(BLOCK)
    batch.rebuild([decoding(0, 9, [1, 2])])  # position 8 needs block index 2
    assert batch.slot_mapping.tolist() == [PADDING_SLOT]
    batch.check()


def test_the_plan_is_a_decode_step_of_every_row() -> None:
    batch = DecodeBatch(BLOCK)
    batch.rebuild(rows())
    plan = batch.plan(released_slots=(4,), new_requests=())
    assert not plan.is_prefill and plan.block_size == BLOCK
    assert plan.query_lens.tolist() == [1, 1, 1]
    assert plan.cu_seqlens_q.tolist() == [0, 1, 2, 3]
    assert plan.sample_indices.tolist() == [0, 1, 2]
    assert plan.sample_slots.tolist() == [0, 1, 2]
    assert plan.max_seqlen_q == 1 and plan.max_seqlen_k == 9
    assert plan.block_table(1) == [7, BLOCK_TABLE_FILLER, BLOCK_TABLE_FILLER]
    assert plan.released_slots == (4,)
    batch.advance([11, 12, 13])  # later steps never change an issued plan
    assert plan.positions.tolist() == [5, 2, 8]
    assert plan.input_ids.tolist() == [5, 102, 208]


def test_advance_appends_the_tokens_and_moves_every_row_on() -> None:
    batch = DecodeBatch(BLOCK)
    a, b, c = rows()
    batch.rebuild([a, b, c])
    batch.advance([11, 12, 13])
    assert [seq.token_ids[-1] for seq in (a, b, c)] == [11, 12, 13]
    assert batch.input_ids.tolist() == [11, 12, 13]
    assert batch.positions.tolist() == [6, 3, 9]
    assert batch.context_lens.tolist() == [7, 4, 10]
    assert batch.cu_seqlens_k.tolist() == [0, 7, 11, 21]
    assert batch.slot_mapping.tolist() == [9 * BLOCK + 2, 7 * BLOCK + 3, 5 * BLOCK + 1]
    batch.check()
    batch.advance([21, 22, 23])
    # Row 1 filled block 7 with position 3: its next token (position 4) needs a new block,
    # and its slot is stale until it gets one.
    assert batch.positions.tolist() == [7, 4, 10]
    batch.check()
    b.block_table.append(8)
    batch.grew(b)
    assert batch.slot_mapping.tolist() == [9 * BLOCK + 3, 8 * BLOCK + 0, 5 * BLOCK + 2]
    assert batch.block_table_row(1) == [7, 8, BLOCK_TABLE_FILLER]
    batch.check()


def test_advance_rejects_a_wrong_number_of_tokens_and_changes_nothing() -> None:
    batch = DecodeBatch(BLOCK)
    seqs = rows()
    batch.rebuild(seqs)
    before = [list(seq.token_ids) for seq in seqs]
    with pytest.raises(ValueError, match="2 sampled tokens for 3 rows"):
        batch.advance([1, 2])
    with pytest.raises(TypeError, match="integer"):
        batch.advance([1, 2, "x"])  # type: ignore[list-item]
    assert [seq.token_ids for seq in seqs] == before
    batch.check()


def test_remove_keeps_the_other_rows_and_narrows_the_tables() -> None:
    batch = DecodeBatch(BLOCK)
    a, b, c = rows()
    batch.rebuild([a, b, c])
    version = batch.version
    batch.remove(b)
    assert batch.seq_ids.tolist() == [0, 2] and batch.width == 3
    assert batch.cu_seqlens_k.tolist() == [0, 6, 15]
    batch.check()
    batch.remove(c)  # the widest row: tables shrink to the longest remaining one
    assert batch.width == 2 and batch.block_tables.tolist() == [3, 9]
    assert batch.max_context_len == 6
    assert batch.version > version
    batch.check()
    batch.remove(a)
    assert len(batch) == 0 and batch.width == 0 and batch.cu_seqlens_k.tolist() == [0]
    plan = batch.plan(released_slots=(), new_requests=())
    assert plan.num_seqs == plan.num_tokens == plan.num_samples == 0


def test_a_new_block_past_the_widest_row_widens_every_row() -> None:
    batch = DecodeBatch(BLOCK)
    a, b = decoding(0, 9, [1, 2]), decoding(1, 2, [4])
    batch.rebuild([a, b])
    a.block_table.append(3)
    batch.grew(a)
    assert batch.width == 3
    assert batch.block_tables.tolist() == [1, 2, 3, 4, 0, 0]
    assert batch.slot_mapping.tolist() == [3 * BLOCK, 4 * BLOCK + 1]
    batch.check()


def test_check_finds_a_corrupted_row() -> None:
    batch = DecodeBatch(BLOCK)
    batch.rebuild(rows())
    batch.positions[1] += 1
    with pytest.raises(AssertionError, match="positions"):
        batch.check()
    batch.rebuild(rows())
    batch.slot_mapping[0] += 1
    with pytest.raises(AssertionError, match="row 0: slot"):
        batch.check()


def test_extend_appends_rows_like_a_rebuild() -> None:
    a, b, c = rows()
    batch = DecodeBatch(BLOCK)
    batch.rebuild([a])
    batch.extend([b])  # narrower than the existing rows: padded to their width
    batch.check()
    batch.extend([c])  # wider: every row is laid out again
    assert batch.seq_ids.tolist() == [0, 1, 2] and batch.width == 3
    batch.check()
    fresh = DecodeBatch(BLOCK)
    fresh.rebuild([a, b, c])
    plan = batch.plan(released_slots=(), new_requests=())
    assert plan == fresh.plan(released_slots=(), new_requests=())


def test_the_row_count_can_grow_past_the_counting_arrays() -> None:
    batch = DecodeBatch(BLOCK)
    seqs = [decoding(i, 3, [i]) for i in range(150)]
    batch.extend(seqs[:70])
    batch.extend(seqs[70:])
    plan = batch.plan(released_slots=(), new_requests=())
    assert plan.sample_indices.tolist() == list(range(150))
    assert plan.cu_seqlens_q.tolist() == list(range(151))
    batch.advance([1] * 150)
    batch.check()


def test_every_kv_group_keeps_its_rows_through_growth_freeing_and_removal() -> None:
    """Three groups: each row's group tables and slots follow the sequences' tables through
    a step, a new block, a window freeing a block in place and a row leaving."""
    a, b = decoding(0, 6, [3, 9]), decoding(1, 3, [7])
    a.group_block_tables = [[13, 19], [23, 29]]
    b.group_block_tables = [[17], [27]]
    batch = DecodeBatch(BLOCK, num_groups=3)
    batch.rebuild([a, b])
    plan = batch.plan(released_slots=(), new_requests=())
    assert [t.tolist() for t in plan.group_block_tables] == [[13, 19, 17, 0], [23, 29, 27, 0]]
    # Positions 5 and 2: offsets 1 and 2 in their blocks.
    assert [s.tolist() for s in plan.group_slot_mappings] == [
        [19 * BLOCK + 1, 17 * BLOCK + 2],
        [29 * BLOCK + 1, 27 * BLOCK + 2],
    ]
    batch.advance([1, 2])  # positions 6 and 3
    batch.check()
    assert [s.tolist() for s in batch.group_slot_mappings] == [
        [19 * BLOCK + 2, 17 * BLOCK + 3],
        [29 * BLOCK + 2, 27 * BLOCK + 3],
    ]
    batch.advance([3, 4])  # b's position 4 opens its second block
    for table, block in zip((b.block_table, *b.group_block_tables), (8, 18, 28), strict=True):
        table.append(block)
    batch.grew(b)
    batch.check()
    assert [s.tolist()[1] for s in batch.group_slot_mappings] == [18 * BLOCK, 28 * BLOCK]
    a.group_block_tables[1][0] = BLOCK_TABLE_FILLER  # group 2's window left a's first block
    batch.refresh_table(a)
    batch.check()
    assert batch.group_block_tables[1].tolist() == [BLOCK_TABLE_FILLER, 29, 27, 28]
    assert batch.group_block_tables[0].tolist() == [13, 19, 17, 18]  # the others unchanged
    batch.remove(a)
    batch.check()
    plan = batch.plan(released_slots=(), new_requests=())
    assert [t.tolist() for t in plan.group_block_tables] == [[17, 18], [27, 28]]
    assert [s.tolist() for s in plan.group_slot_mappings] == [[18 * BLOCK], [28 * BLOCK]]
