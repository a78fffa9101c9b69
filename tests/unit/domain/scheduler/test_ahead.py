"""Planned-ahead (async) scheduling by example: ``schedule_ahead`` plans the next step while
the plan in flight runs, its decode rows carry that plan's samples, and the record (or a
roll back) puts the real tokens in. The property machine (tests/property) checks the same
against the sync loop; these pin what one step looks like."""

from __future__ import annotations

from array import array

import pytest

from pagedinfer.domain import (
    FinishReason,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
)
from pagedinfer.domain.decode_batch import DecodeBatch
from pagedinfer.domain.plan import PENDING_TOKEN, BatchPlan
from pagedinfer.domain.scheduler.ahead import carried_rows


def decoding_pair(max_tokens: int = 8) -> tuple[Scheduler, Sequence, Sequence]:
    """A scheduler whose two requests have prefilled and sampled their first token."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32))
    a = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    b = Sequence(1, [4, 5], SamplingParams(max_tokens=max_tokens))
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule()
    assert plan is not None and plan.num_decode_rows == 0
    scheduler.postprocess(plan, [10, 20])
    assert a.decoding and b.decoding
    return scheduler, a, b


def test_a_plan_made_ahead_carries_the_pending_tokens_of_the_plan_in_flight() -> None:
    scheduler, a, b = decoding_pair()
    first = scheduler.schedule()
    assert first is not None and not first.made_ahead
    ahead = scheduler.schedule_ahead()
    assert ahead is not None
    assert ahead.made_ahead
    assert ahead.step_id == first.step_id + 1
    assert ahead.recorded_step_id == first.recorded_step_id  # first is not recorded yet
    assert ahead.input_ids.tolist() == [PENDING_TOKEN, PENDING_TOKEN]
    assert ahead.carried_rows.tolist() == [0, 1]
    assert ahead.carried_samples.tolist() == [0, 1]
    assert ahead.positions.tolist() == [4, 3]  # one past the plan in flight's
    # Until the plan in flight is recorded its tokens are pending in the sequences.
    assert a.token_ids[-1] == PENDING_TOKEN and b.token_ids[-1] == PENDING_TOKEN
    assert [s.seq_id for s in scheduler.postprocess(first, [11, 21])] == [0, 1]
    assert a.token_ids == [1, 2, 3, 10, 11]
    assert b.token_ids == [4, 5, 20, 21]
    assert [s.seq_id for s in scheduler.postprocess(ahead, [12, 22])] == [0, 1]
    assert a.token_ids == [1, 2, 3, 10, 11, 12]
    assert b.token_ids == [4, 5, 20, 21, 22]
    scheduler.check_integrity()


def test_a_sync_plan_carries_nothing() -> None:
    scheduler, _, _ = decoding_pair()
    plan = scheduler.schedule()
    assert plan is not None
    assert not plan.made_ahead and not plan.carried_rows and not plan.carried_samples


def test_the_records_must_come_in_order() -> None:
    scheduler, _, _ = decoding_pair()
    first = scheduler.schedule()
    ahead = scheduler.schedule_ahead()
    assert first is not None and ahead is not None
    with pytest.raises(ValueError, match="the older plan in flight first"):
        scheduler.postprocess(ahead, [1, 2])
    with pytest.raises(ValueError, match="once"):
        scheduler.schedule_ahead()  # one plan ahead at most


def test_a_sequence_that_finishes_in_flight_has_its_row_ahead_discarded() -> None:
    scheduler, a, b = decoding_pair(max_tokens=2)  # the next token is the last
    first = scheduler.schedule()
    ahead = scheduler.schedule_ahead()
    assert first is not None and ahead is not None
    finished = scheduler.postprocess(first, [11, 21])
    assert [s.finish_reason for s in finished] == [FinishReason.LENGTH, FinishReason.LENGTH]
    assert scheduler.postprocess(ahead, [12, 22]) == []
    assert a.token_ids == [1, 2, 3, 10, 11] and b.token_ids == [4, 5, 20, 21]
    assert not scheduler.has_unfinished()


def test_schedule_after_a_failed_plan_rolls_both_back() -> None:
    scheduler, a, b = decoding_pair()
    first = scheduler.schedule()
    ahead = scheduler.schedule_ahead()
    assert first is not None and ahead is not None
    again = scheduler.schedule()  # neither was recorded: as if none had run
    assert again is not None
    assert a.token_ids == [1, 2, 3, 10] and b.token_ids == [4, 5, 20]
    assert again.input_ids.tolist() == [10, 20]
    assert again.positions.tolist() == first.positions.tolist()
    scheduler.postprocess(again, [11, 21])
    assert a.token_ids == [1, 2, 3, 10, 11]
    scheduler.check_integrity()


def test_a_prompt_chunk_that_samples_waits_for_its_record() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32))
    seq = Sequence(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    scheduler.add(seq)
    first = scheduler.schedule()
    assert first is not None and first.num_samples == 1
    # Its next step needs the token the plan in flight samples: nothing else can run.
    assert scheduler.schedule_ahead() is None
    scheduler.postprocess(first, [9])
    assert seq.decoding and seq.token_ids[-1] == 9


def test_carried_rows_are_searched_when_rows_left_since() -> None:
    rows = DecodeBatch(block_size=4)
    seqs = [Sequence(i, [1, 2]) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.block_table = [i]
        seq.slot = i
        seq.start_decoding()
    rows.rebuild(seqs)
    in_flight = rows.plan(released_slots=(), new_requests=())
    rows.advance_pending()
    rows.remove(seqs[0])  # finished while the plan in flight ran
    late = Sequence(7, [3, 4, 5])  # joined since: its input is known
    late.block_table = [5]
    late.start_decoding()
    rows.extend([late])
    carried, samples = carried_rows(in_flight, rows, only_appended=False)
    assert carried.tolist() == [0, 1]
    assert samples.tolist() == [1, 2]  # seqs 1 and 2 were the plan in flight's rows 1, 2


def test_carried_rows_when_rows_were_only_appended() -> None:
    plan = BatchPlan(
        is_prefill=False,
        block_size=4,
        seq_ids=array("q", [0, 1]),
        query_lens=array("i", [1, 1]),
        context_lens=array("i", [3, 3]),
        cu_seqlens_q=array("i", [0, 1, 2]),
        cu_seqlens_k=array("i", [0, 3, 6]),
        max_seqlen_q=1,
        max_seqlen_k=3,
        block_tables=array("i", [0, 1]),
        block_table_width=1,
        input_ids=array("q", [5, 6]),
        positions=array("q", [2, 2]),
        slot_mapping=array("q", [2, 6]),
        sample_indices=array("q", [0, 1]),
        sample_slots=array("i", [0, 1]),
    )
    rows = DecodeBatch(block_size=4)
    seqs = [Sequence(i, [1, 2, 3, 4]) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.block_table = [i, 3 + i]
        seq.start_decoding()
    rows.rebuild(seqs)
    carried, samples = carried_rows(plan, rows, only_appended=True)
    assert carried.tolist() == [0, 1] and samples.tolist() == [0, 1]
    assert carried is not samples  # two arrays: a plan owns each of its fields
