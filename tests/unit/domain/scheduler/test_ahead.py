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


def run_pipelined(scheduler: Scheduler, sample: int = 7, *, max_steps: int = 200) -> int:
    """Plan step N+1 while step N is in flight until nothing is left; the number of plans."""
    in_flight = scheduler.schedule()
    count = 0
    while in_flight is not None and count < max_steps:
        count += 1
        following = scheduler.schedule_ahead()
        scheduler.postprocess(in_flight, [sample] * in_flight.num_samples)
        scheduler.check_integrity()
        in_flight = following if following is not None else scheduler.schedule()
    assert not scheduler.has_unfinished()
    return count


def test_planning_ahead_gives_the_sync_loops_tokens_and_blocks() -> None:
    def scheduler_with_requests() -> tuple[Scheduler, list[Sequence]]:
        scheduler = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64))
        seqs = [
            Sequence(i, list(range(1, 3 + 3 * i)), SamplingParams(max_tokens=5 + 2 * i))
            for i in range(3)
        ]
        for seq in seqs:
            scheduler.add(seq)
        return scheduler, seqs

    sync, expected = scheduler_with_requests()
    plan = sync.schedule()
    while plan is not None:
        sync.postprocess(plan, [7] * plan.num_samples)
        plan = sync.schedule()
    ahead, seqs = scheduler_with_requests()
    run_pipelined(ahead)
    assert [s.token_ids for s in seqs] == [s.token_ids for s in expected]
    assert [s.finish_reason for s in seqs] == [FinishReason.LENGTH] * 3
    assert ahead.pool.num_free_blocks == sync.pool.num_free_blocks == 32


def test_a_row_crossing_into_a_new_block_gets_it_in_the_plan_made_ahead() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32))
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=8))
    scheduler.add(seq)
    prefill = scheduler.schedule()
    assert prefill is not None
    scheduler.postprocess(prefill, [10])  # 4 tokens: block 0 is full once 10 is computed
    first = scheduler.schedule()
    assert first is not None and first.positions.tolist() == [3]
    ahead = scheduler.schedule_ahead()
    assert ahead is not None and ahead.positions.tolist() == [4]
    assert len(seq.block_table) == 2  # given while the plan in flight runs
    assert ahead.slot_mapping.tolist() == [seq.block_table[1] * 4]
    scheduler.postprocess(first, [11])
    scheduler.postprocess(ahead, [12])
    assert seq.token_ids == [1, 2, 3, 10, 11, 12]
    scheduler.check_integrity()


def test_a_request_added_in_flight_is_admitted_ahead_beside_the_carried_rows() -> None:
    scheduler, _, b = decoding_pair()
    first = scheduler.schedule()
    assert first is not None
    late = Sequence(2, [7, 8, 9], SamplingParams(max_tokens=2))
    scheduler.add(late)
    ahead = scheduler.schedule_ahead()
    assert ahead is not None
    assert ahead.seq_ids.tolist() == [0, 1, 2]  # the two rows, then the new prompt
    assert ahead.num_decode_rows == 2
    assert ahead.carried_rows.tolist() == [0, 1]  # the prompt's inputs are known
    assert ahead.input_ids.tolist() == [PENDING_TOKEN, PENDING_TOKEN, 7, 8, 9]
    scheduler.postprocess(first, [11, 21])
    scheduler.postprocess(ahead, [12, 22, 30])
    assert late.token_ids == [7, 8, 9, 30] and late.decoding
    assert b.token_ids == [4, 5, 20, 21, 22]
    scheduler.check_integrity()


def test_an_abort_between_the_two_records_discards_its_row_ahead() -> None:
    scheduler, a, b = decoding_pair()
    first = scheduler.schedule()
    ahead = scheduler.schedule_ahead()
    assert first is not None and ahead is not None
    scheduler.postprocess(first, [11, 21])
    assert scheduler.abort(a.seq_id)
    assert a.token_ids == [1, 2, 3, 10, 11]  # its pending token is gone with it
    assert [s.seq_id for s in scheduler.postprocess(ahead, [12, 22])] == [1]
    assert a.token_ids == [1, 2, 3, 10, 11] and b.token_ids == [4, 5, 20, 21, 22]
    following = scheduler.schedule()
    assert following is not None and following.seq_ids.tolist() == [1]
    scheduler.check_integrity()


def test_an_abort_after_a_failed_step_rolls_the_rest_back_and_plans_it_again() -> None:
    scheduler, a, b = decoding_pair()
    first = scheduler.schedule()
    ahead = scheduler.schedule_ahead()
    assert first is not None and ahead is not None
    free_in_flight = scheduler.pool.num_free_blocks
    assert scheduler.abort(a.seq_id)  # the step failed: the engine ends its sequences...
    again = scheduler.schedule()  # ...and plans the rest again, as if neither plan ran
    assert again is not None
    assert again.seq_ids.tolist() == [1] and again.input_ids.tolist() == [20]
    assert not again.made_ahead and not again.carried_rows
    assert b.token_ids == [4, 5, 20]
    assert scheduler.pool.num_free_blocks >= free_in_flight
    scheduler.postprocess(again, [21])
    assert b.token_ids == [4, 5, 20, 21]
    scheduler.check_integrity()


def test_a_rolled_back_chunk_is_computed_again() -> None:
    config = SchedulerConfig(
        num_blocks=16, block_size=4, max_model_len=32, max_num_batched_tokens=4
    )
    scheduler = Scheduler(config)
    seq = Sequence(0, list(range(1, 11)), SamplingParams(max_tokens=2))  # 10: three chunks
    scheduler.add(seq)
    first = scheduler.schedule()
    assert first is not None and first.query_lens.tolist() == [4]
    ahead = scheduler.schedule_ahead()  # counts the first chunk as computed
    assert ahead is not None and ahead.positions.tolist() == [4, 5, 6, 7]
    assert seq.num_computed_tokens == 4 and len(seq.block_table) == 2
    again = scheduler.schedule()  # neither recorded: the first chunk runs again
    assert again is not None and again.positions.tolist() == [0, 1, 2, 3]
    assert seq.num_computed_tokens == 0 and len(seq.block_table) == 1
    scheduler.check_integrity()


def test_schedule_ahead_needs_exactly_one_plan_in_flight_and_no_speculation() -> None:
    scheduler, _, _ = decoding_pair()
    with pytest.raises(ValueError, match="after schedule"):
        scheduler.schedule_ahead()  # nothing in flight (the last plan was recorded)
    speculating = Scheduler(
        SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32, num_speculative_tokens=2)
    )
    speculating.add(Sequence(0, [1, 2, 3]))
    assert speculating.schedule() is not None
    with pytest.raises(ValueError, match="speculative decoding"):
        speculating.schedule_ahead()


def test_a_chunk_planned_again_shorter_keeps_the_dropped_chunks_blocks_for_the_next() -> None:
    # A chunk planned ahead is dropped (its step failed) after a decode row joined: planned
    # again in what the row leaves of the budget, it is shorter, and the sequence keeps the
    # block of the dropped chunk's last token past the record; its next chunk writes it,
    # and nothing is left held at the end.
    config = SchedulerConfig(
        num_blocks=12,
        block_size=1,
        max_model_len=12,
        max_num_batched_tokens=3,
        scheduling_policy="mixed",
    )
    scheduler = Scheduler(config)
    a = Sequence(0, [1], SamplingParams(max_tokens=4, ignore_eos=True))
    b = Sequence(1, [1, 1, 1, 1, 6, 34], SamplingParams(max_tokens=1, ignore_eos=True))
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    assert first is not None and first.query_lens.tolist() == [1, 2]
    ahead = scheduler.schedule_ahead()  # a's chunk samples: only b's next chunk
    assert ahead is not None and ahead.seq_ids.tolist() == [1]
    assert ahead.query_lens.tolist() == [3] and len(b.block_table) == 5
    scheduler.postprocess(first, [7])
    assert a.decoding
    # The plan made ahead fails: planned again, a's row takes one token of the budget.
    again = scheduler.schedule()
    assert again is not None and again.seq_ids.tolist() == [0, 1]
    assert again.query_lens.tolist() == [1, 2]
    kept = b.block_table[4]
    scheduler.postprocess(again, [8])
    assert b.num_computed_tokens == 4 and len(b.block_table) == 5  # one past what it computed
    scheduler.check_integrity()
    nxt = scheduler.schedule()
    assert nxt is not None and nxt.query_lens.tolist() == [1, 2]
    assert b.block_table[4] == kept and len(b.block_table) == 6  # written, one more given
    scheduler.postprocess(nxt, [9, 10])
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        assert plan is not None
        scheduler.postprocess(plan, [11] * plan.num_samples)
    assert scheduler.pool.num_free_blocks == config.num_blocks


def test_a_cached_admission_dropped_and_not_planned_again_prefills_its_last_token() -> None:
    # A request admitted ahead with its prompt cached but for the last token has its
    # one-token chunk dropped (its step failed); planned again, a decode row that joined
    # meanwhile and an older prefill take the budget: it stays prefilling with one token
    # left (not decoding: nothing was sampled for it), and its chunk comes next.
    config = SchedulerConfig(
        num_blocks=16,
        block_size=1,
        max_model_len=12,
        max_num_batched_tokens=3,
        scheduling_policy="mixed",
        enable_prefix_caching=True,
    )
    scheduler = Scheduler(config)
    warm = Sequence(0, [32, 37], SamplingParams(max_tokens=1, ignore_eos=True))
    scheduler.add(warm)
    plan = scheduler.schedule()
    assert plan is not None
    scheduler.postprocess(plan, [9])
    assert warm.is_finished  # its prompt's blocks stay in the prefix cache
    a = Sequence(1, [1], SamplingParams(max_tokens=3, ignore_eos=True))
    b = Sequence(2, [5, 5, 5, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    c = Sequence(3, [32, 40], SamplingParams(max_tokens=2, ignore_eos=True))
    for seq in (a, b, c):
        scheduler.add(seq)
    first = scheduler.schedule()
    assert first is not None and first.query_lens.tolist() == [1, 2]
    ahead = scheduler.schedule_ahead()
    assert ahead is not None and ahead.seq_ids.tolist() == [2, 3]
    assert c.num_computed_tokens == 1  # its first token from the cache
    scheduler.postprocess(first, [7])
    assert a.decoding
    again = scheduler.schedule()  # the plan made ahead failed
    assert again is not None and again.seq_ids.tolist() == [1, 2]
    scheduler.postprocess(again, [8, 6])
    assert not c.decoding and c.num_computed_tokens == c.num_tokens - 1
    scheduler.check_integrity()
    nxt = scheduler.schedule()
    assert nxt is not None and 3 in nxt.sampled_seq_ids  # its last prompt token samples
    scheduler.postprocess(nxt, [4] * nxt.num_samples)
    assert c.completion_token_ids == [4]
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        assert plan is not None
        scheduler.postprocess(plan, [11] * plan.num_samples)
        scheduler.check_integrity()
    assert scheduler.pool.num_free_blocks == config.num_blocks
