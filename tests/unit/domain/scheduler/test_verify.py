"""Verify rows (speculative decoding) as the scheduler records them."""

from __future__ import annotations

import pytest

from pagedinfer.domain import SamplingParams, Scheduler, SchedulerConfig, Sequence, build_batch_plan
from pagedinfer.domain.plan import ScheduledChunk
from pagedinfer.domain.scheduler.verify import (
    RowDecoding,
    VerifyDecoding,
    VerifyStats,
    decoding_policy,
    kept_drafts,
    verified_rows,
)


def test_accept_keeps_the_matching_drafts_and_the_next_sample() -> None:
    stats = VerifyStats(num_speculative_tokens=3)
    assert stats.accept([5, 6, 7], [5, 6, 9, 4]) == [5, 6, 9]  # draft 7 rejected: 9 instead
    assert stats.accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all kept + bonus token
    assert stats.accept([5], [1, 2]) == [1]
    assert stats.num_rows == 3
    assert stats.num_draft_tokens == 7
    assert stats.num_accepted_tokens == 5
    assert stats.accepted_per_position == [2, 2, 1]


def test_kept_drafts_respect_the_limit_and_the_room() -> None:
    assert kept_drafts([1, 2, 3, 4], limit=3, room=10) == [1, 2, 3]
    assert kept_drafts([1, 2, 3, 4], limit=3, room=1) == [1]
    assert kept_drafts([1, 2], limit=3, room=-1) == []


def test_verified_rows_pair_each_rows_drafts_with_its_samples() -> None:
    seq = Sequence(3, [1, 2, 3, 4, 5])
    seq.block_table = [0, 1]
    seq.slot = 0
    seq.num_computed_tokens = 4
    seq.spec_token_ids = [8, 9]
    plan = build_batch_plan([ScheduledChunk(seq, 3)], is_prefill=True, block_size=4)
    assert plan.verify_rows == ((0, 0, 2),)
    assert verified_rows(plan, [8, 7, 6]) == {3: ([8, 9], [8, 7, 6])}


def test_the_scheduler_counts_and_keeps_what_its_verify_row_accepts() -> None:
    config = SchedulerConfig(
        num_blocks=16, block_size=4, max_model_len=64, num_speculative_tokens=2
    )
    scheduler = Scheduler(config)
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=20))
    scheduler.add(seq)
    plan = scheduler.schedule()
    assert plan is not None
    scheduler.postprocess(plan, [4])
    assert scheduler.set_drafts(0, [5, 6, 7]) == 2  # at most num_speculative_tokens
    plan = scheduler.schedule()
    assert plan is not None and plan.verify_rows == ((0, 0, 2),)
    scheduler.postprocess(plan, [5, 9, 1])  # draft 5 accepted, 6 rejected (9 instead)
    assert seq.token_ids == [1, 2, 3, 4, 5, 9]
    assert seq.num_computed_tokens == 5  # the tokens up to 4 and the accepted draft
    stats = scheduler.stats()
    assert (stats.num_spec_verify_rows, stats.num_draft_tokens, stats.num_accepted_tokens) == (
        1,
        2,
        1,
    )
    assert stats.accepted_per_position == (1, 0)


def test_the_decoding_policy_is_chosen_once_from_the_number_of_drafts() -> None:
    assert isinstance(decoding_policy(0), RowDecoding)
    policy = decoding_policy(2)
    assert isinstance(policy, VerifyDecoding) and policy.num_speculative_tokens == 2


def test_without_speculation_one_token_left_decodes_and_drafts_are_ignored() -> None:
    policy = RowDecoding()
    seq = Sequence(0, [1, 2, 3])
    seq.num_computed_tokens = 1
    assert not policy.ready_to_decode(seq)  # two prompt tokens to compute: a chunk
    seq.num_computed_tokens = 2
    assert policy.ready_to_decode(seq)
    assert policy.drafts([5, 6], room=10) == []
    policy.check_plan_ahead()  # no objection


def test_speculating_a_sequence_never_decodes_in_rows_and_keeps_its_drafts() -> None:
    policy = VerifyDecoding(num_speculative_tokens=2)
    seq = Sequence(0, [1, 2, 3])
    seq.num_computed_tokens = 2
    assert not policy.ready_to_decode(seq)  # its last token and drafts: a verify chunk
    assert policy.drafts([5, 6, 7], room=10) == [5, 6]
    assert policy.drafts([5, 6, 7], room=1) == [5]
    with pytest.raises(ValueError, match="use schedule"):
        policy.check_plan_ahead()
