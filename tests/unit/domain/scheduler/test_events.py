"""Scheduler events: preemptions, prefix-cache hits and every finish, drained by the caller."""

from __future__ import annotations

import pytest

from pagedinfer.domain import (
    FinishReason,
    PrefixCacheHit,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerEvent,
    Sequence,
    SequenceFinished,
    SequencePreempted,
    make_forks,
)
from pagedinfer.errors import ConfigurationError

from ..driver import constant_sampler, hash_sampler, run_to_completion, step

EOS = 0


def make_scheduler(num_blocks: int = 64, **config: object) -> Scheduler:
    settings: dict[str, object] = {
        "num_blocks": num_blocks,
        "block_size": 4,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 64,
        "eos_token_ids": frozenset({EOS}),
        **config,
    }
    return Scheduler(SchedulerConfig(**settings), record_events=True)  # type: ignore[arg-type]


def finished(events: list[SchedulerEvent]) -> dict[int, FinishReason]:
    return {e.seq_id: e.reason for e in events if isinstance(e, SequenceFinished)}


def test_events_are_off_by_default_and_draining_them_says_how_to_turn_them_on() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32))
    scheduler.add(Sequence(0, [1, 2, 3], SamplingParams(max_tokens=2)))
    run_to_completion(scheduler, constant_sampler(5))
    with pytest.raises(ConfigurationError, match="record_events=True"):
        scheduler.drain_events()


def test_finishes_by_length_and_by_eos_are_reported_once_with_the_sequence() -> None:
    scheduler = make_scheduler()
    by_length = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=3))
    by_eos = Sequence(1, [4, 5, 6], SamplingParams(max_tokens=10))
    scheduler.add(by_length)
    scheduler.add(by_eos)
    step(scheduler, constant_sampler(7))  # prefill: one token each
    assert scheduler.drain_events() == []
    plan = scheduler.schedule()
    assert plan is not None and plan.sampled_seq_ids == [0, 1]
    scheduler.postprocess(plan, [7, EOS])
    events = scheduler.drain_events()
    assert events == [SequenceFinished(by_eos, FinishReason.STOP)]
    assert events[0].seq is by_eos and by_eos.completion_token_ids == [7, EOS]
    run_to_completion(scheduler, constant_sampler(7))
    assert scheduler.drain_events() == [SequenceFinished(by_length, FinishReason.LENGTH)]
    assert scheduler.drain_events() == []  # drained events are forgotten


def test_aborts_and_finishes_outside_a_step_are_reported() -> None:
    scheduler = make_scheduler()
    waiting = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=5))
    scheduler.add(waiting)
    assert scheduler.abort(0)
    scheduler.add(running := Sequence(1, [1, 2, 3], SamplingParams(max_tokens=5)))
    plan = scheduler.schedule()
    assert plan is not None
    assert scheduler.finish(1, FinishReason.STOP) is running  # a stop string, mid-step
    scheduler.postprocess(plan, [9])  # the finished sequence is skipped
    assert finished(scheduler.drain_events()) == {0: FinishReason.ABORT, 1: FinishReason.STOP}
    assert running.completion_token_ids == []


def test_completions_cancelled_with_their_request_are_reported() -> None:
    """Aborting a request before its prompt is computed ends its unstarted completions: they
    never received a token, so postprocess never returns them; events do."""
    scheduler = make_scheduler()
    first = Sequence(0, list(range(1, 11)), SamplingParams(max_tokens=4, n=3, seed=5))
    forks = make_forks(first)
    scheduler.add(first, forks=forks)
    plan = scheduler.schedule()
    assert plan is not None
    assert scheduler.abort(0)
    scheduler.postprocess(plan, [1] * plan.num_samples)
    assert finished(scheduler.drain_events()) == {i: FinishReason.ABORT for i in (0, 1, 2)}
    assert all(seq.is_finished for seq in forks)
    assert not scheduler.has_unfinished()


def test_preemptions_are_reported_and_match_the_sequences() -> None:
    # 8 blocks of 4 tokens: three requests growing to 20 tokens each cannot all fit.
    scheduler = make_scheduler(num_blocks=8, max_model_len=32)
    seqs = [
        Sequence(i, [1 + i] * 6, SamplingParams(max_tokens=14, ignore_eos=True)) for i in range(3)
    ]
    for seq in seqs:
        scheduler.add(seq)
    events: list[SchedulerEvent] = []
    for _ in range(200):
        if step(scheduler, hash_sampler()) is None:
            break
        events += scheduler.drain_events()
    preempted = [e for e in events if isinstance(e, SequencePreempted)]
    assert preempted, "the small pool is meant to preempt"
    assert len(preempted) == scheduler.stats().num_preemptions
    for seq in seqs:
        assert sum(e.seq_id == seq.seq_id for e in preempted) == seq.num_preemptions
    assert all(e.num_tokens > 6 for e in preempted)  # they had generated tokens
    assert finished(events) == {i: FinishReason.LENGTH for i in range(3)}
    # Every preempted sequence finds its own earlier blocks again when readmitted.
    readmitted = [e for e in events if isinstance(e, PrefixCacheHit) and e.readmitted]
    assert {e.seq_id for e in readmitted} <= {e.seq_id for e in preempted}


def test_prefix_cache_hits_are_reported_at_admission() -> None:
    scheduler = make_scheduler()
    system = [5, 6, 7, 8, 9, 10, 11, 12]  # two full blocks
    scheduler.add(Sequence(0, [*system, 1], SamplingParams(max_tokens=1)))
    run_to_completion(scheduler, constant_sampler(3))
    assert not [e for e in scheduler.drain_events() if isinstance(e, PrefixCacheHit)]
    scheduler.add(Sequence(1, [*system, 2, 3], SamplingParams(max_tokens=1)))
    scheduler.add(Sequence(2, [99, 98, 97, 96, 95], SamplingParams(max_tokens=1)))
    run_to_completion(scheduler, constant_sampler(3))
    hits = [e for e in scheduler.drain_events() if isinstance(e, PrefixCacheHit)]
    assert hits == [PrefixCacheHit(1, 8, readmitted=False)]


def test_events_cost_nothing_when_off() -> None:
    """Without record_events the scheduler keeps no event list at all."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32))
    assert scheduler._events is None
