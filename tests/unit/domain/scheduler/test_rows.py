"""DecodeRows by example: rows join in running order, are moved on and recorded in bulk, say
which rows need a block and which stop, and roll back a plan made ahead."""

from __future__ import annotations

import pytest

from pagedinfer.domain import BlockPool, FinishReason, SamplingParams, Sequence, SequenceStatus
from pagedinfer.domain.plan import PENDING_TOKEN, BatchPlan
from pagedinfer.domain.scheduler.allocator import BlockAllocator
from pagedinfer.domain.scheduler.rows import DecodeRows
from pagedinfer.domain.scheduler.stop_rules import StopRules

BLOCK = 4
EOS = 0


def make_rows(num_blocks: int = 16) -> tuple[DecodeRows, BlockAllocator]:
    allocator = BlockAllocator(BlockPool(num_blocks, BLOCK))
    return DecodeRows(allocator, StopRules(frozenset({EOS}), max_model_len=32)), allocator


def decoding(allocator: BlockAllocator, seq_id: int, num_tokens: int) -> Sequence:
    """A running sequence whose prompt is computed but for its last token, with the blocks
    of that token."""
    seq = Sequence(seq_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=16))
    assert allocator.allocate_slots(seq, num_tokens) is not None
    seq.num_computed_tokens = num_tokens - 1
    seq.status = SequenceStatus.RUNNING
    seq.slot = seq_id
    return seq


def plan_of(rows: DecodeRows) -> BatchPlan:
    plan = rows.batch.plan(released_slots=(), new_requests=())
    rows.planned()
    return plan


def test_rows_join_at_the_next_update_in_running_order() -> None:
    rows, allocator = make_rows()
    a, b = decoding(allocator, 0, 3), decoding(allocator, 1, 2)
    running = [a, b]
    assert not rows.update(running)  # no decoding sequence yet
    rows.join(b)
    rows.join(a)  # joined later, but older in running order
    assert a.decoding and b.decoding
    assert rows.seqs == []  # rows from the next update on
    assert rows.update(running)
    assert rows.seqs == [a, b]
    assert not rows.stale and rows.joining == []
    rows.check(running)


def test_a_row_joining_before_existing_rows_rebuilds_them() -> None:
    rows, allocator = make_rows()
    a, b = decoding(allocator, 0, 3), decoding(allocator, 1, 2)
    running = [a, b]
    rows.join(b)
    rows.update(running)
    rows.join(a)  # an older chunked prefill finished after the newer one
    removals = rows.batch.removals
    assert rows.update(running)
    assert rows.seqs == [a, b]
    assert rows.batch.removals > removals  # laid out again, not appended
    rows.check(running)


def test_a_step_moves_every_row_on_and_records_the_stops() -> None:
    rows, allocator = make_rows()
    a, b, c = (decoding(allocator, i, 3) for i in range(3))
    known = {seq.seq_id: seq for seq in (a, b, c)}
    for seq in (a, b, c):
        rows.join(seq)
    rows.update([a, b, c])
    plan = plan_of(rows)
    rows.move_on(plan, [7, EOS, 8], known)
    assert [seq.token_ids[-1] for seq in (a, b, c)] == [7, EOS, 8]
    updated, finishing = rows.record(plan, [7, EOS, 8], known, filled=True)
    assert updated == [a, b, c]
    assert finishing == {b: FinishReason.STOP}  # the loop finishes it
    assert rows.steps_done == 1


def test_a_row_at_its_length_limit_finishes_when_recorded() -> None:
    rows, allocator = make_rows()
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=2))
    seq.token_ids.append(10)  # its first completion token: the next one is the last
    assert allocator.allocate_slots(seq, 4) is not None
    seq.num_computed_tokens = 3
    seq.status = SequenceStatus.RUNNING
    known = {0: seq}
    rows.join(seq)
    rows.update([seq])
    plan = plan_of(rows)
    rows.move_on(plan, [9], known)
    assert rows.record(plan, [9], known, filled=True) == ([seq], {seq: FinishReason.LENGTH})


def test_the_row_whose_block_fills_up_needs_a_block_after_that_step() -> None:
    rows, allocator = make_rows()
    seq = decoding(allocator, 0, 4)  # its next token is the last of block 0
    known = {0: seq}
    rows.join(seq)
    running = [seq]
    assert rows.blocks_needed(running) == []
    rows.update(running)
    plan = plan_of(rows)
    rows.move_on(plan, [9], known)
    rows.record(plan, [9], known, filled=True)
    assert rows.blocks_needed(running) == [seq]  # the loop gives it one, or preempts
    assert allocator.append_block(seq) is not None
    rows.grew(seq)
    assert rows.update(running)
    rows.check(running)
    assert rows.blocks_needed(running) == []  # asked once per step


def test_a_row_that_left_makes_the_record_go_row_by_row() -> None:
    rows, allocator = make_rows()
    a, b = decoding(allocator, 0, 3), decoding(allocator, 1, 3)
    known = {0: a, 1: b}
    rows.join(a)
    rows.join(b)
    rows.update([a, b])
    plan = plan_of(rows)
    rows.move_on(plan, None, known)  # planning ahead: the tokens are pending
    assert a.token_ids[-1] == PENDING_TOKEN and b.token_ids[-1] == PENDING_TOKEN
    rows.leave(a)  # aborted while the plan runs (the loop pops its pending token)
    a.token_ids.pop()
    del known[0]
    updated, finishing = rows.record(plan, [5, 6], known, filled=False)
    assert updated == [b] and finishing == {}
    assert b.token_ids[-1] == 6
    assert rows.stale  # rebuilt before the next decode-row step
    assert rows.update([b]) and rows.seqs == [b]
    rows.check([b])


def test_a_plan_moved_on_ahead_rolls_back() -> None:
    rows, allocator = make_rows()
    seq = decoding(allocator, 0, 4)
    known = {0: seq}
    rows.join(seq)
    rows.update([seq])
    plan = plan_of(rows)
    rows.move_on(plan, None, known)
    assert seq.token_ids[-1] == PENDING_TOKEN and rows.steps_done == 1
    assert rows.blocks_needed([seq]) == [seq]  # planned ahead: its block is given...
    assert allocator.append_block(seq) is not None
    rows.grew(seq)
    rows.roll_back(plan, known, [seq])  # ...but neither plan was recorded
    assert seq.token_ids == [1, 2, 3, 4] and rows.steps_done == 0
    assert len(seq.block_table) == 1  # the block past its next token's is freed
    assert rows.stale
    assert rows.update([seq]) and rows.seqs == [seq]
    rows.check([seq])


def test_check_finds_a_row_that_is_not_a_running_decoder() -> None:
    rows, allocator = make_rows()
    a, b = decoding(allocator, 0, 3), decoding(allocator, 1, 3)
    rows.join(a)
    rows.join(b)
    rows.update([a, b])
    with pytest.raises(AssertionError, match="running decoders"):
        rows.check([a])
