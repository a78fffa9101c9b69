"""Scheduler details that the scenario tests pass through without pinning (found by mutation
testing, docs/testing.md): what a new request hands the sampler, the cache salt, several
rows stopping on one token, requests stopping before their filed work, a forking plan that
is planned again, and preemption counts per request."""

from __future__ import annotations

import pytest

from pagedinfer.domain import (
    FinishReason,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
)

from ..driver import Sampler, constant_sampler, hash_sampler, run_to_completion, step


def make(num_blocks: int = 32, block_size: int = 4, max_model_len: int = 32) -> Scheduler:
    return Scheduler(
        SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len)
    )


def run_checked(scheduler: Scheduler, sampler: Sampler, max_steps: int = 500) -> None:
    """Run to the end, checking every internal invariant after each step."""
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            scheduler.pool.check_integrity()
            assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks
            return
        assert step(scheduler, sampler) is not None
        scheduler.check_integrity()
        scheduler.pool.check_integrity()
    raise AssertionError("not finished")


@pytest.mark.parametrize(
    ("params", "needs_prompt"),
    [
        (SamplingParams(), False),
        (SamplingParams(repetition_penalty=1.3), True),
        (SamplingParams(prompt_logprobs=1), True),
    ],
)
def test_a_new_request_carries_its_prompt_only_when_the_sampler_needs_it(
    params: SamplingParams, needs_prompt: bool
) -> None:
    scheduler = make()
    scheduler.add(Sequence(7, [5, 6, 7], params))
    plan = scheduler.schedule()
    assert plan is not None
    (request,) = plan.new_requests
    assert (request.seq_id, request.slot, request.params, request.num_prompt_tokens) == (
        7,
        0,
        params,
        3,
    )
    assert request.prompt_token_ids == ((5, 6, 7) if needs_prompt else ())


def test_the_cache_salt_keeps_requests_from_sharing_blocks() -> None:
    scheduler = make()
    tokens = list(range(10, 22))  # three full blocks
    first = Sequence(0, tokens, SamplingParams(max_tokens=1), extra_key=1)
    scheduler.add(first)
    run_to_completion(scheduler, constant_sampler(3))
    for seq_id, key, cached in [(1, 2, 0), (2, None, 0), (3, 1, 8)]:
        seq = Sequence(seq_id, tokens, SamplingParams(max_tokens=1), extra_key=key)
        scheduler.add(seq)
        run_to_completion(scheduler, constant_sampler(3))
        # Only the same salt finds the blocks (all but the last block: one token is computed).
        assert seq.num_cached_tokens == cached, key


@pytest.mark.parametrize("rows", [[0, 1, 2], [0, 2], [1, 2], [0, 1, 3]])
def test_every_decode_row_that_samples_a_stop_token_finishes(rows: list[int]) -> None:
    scheduler = make(num_blocks=64)
    params = SamplingParams(max_tokens=10, stop_token_ids=[9])
    seqs = [Sequence(i, [20 + i, 30 + i], params) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    assert step(scheduler, constant_sampler(1)) is not None  # the prefill step
    plan = scheduler.schedule()
    assert plan is not None and plan.sampled_seq_ids == [0, 1, 2, 3]
    assert not plan.is_prefill
    scheduler.postprocess(plan, [9 if i in rows else 1 for i in range(4)])
    scheduler.check_integrity()
    assert [s.finish_reason for s in seqs] == [
        FinishReason.STOP if i in rows else None for i in range(4)
    ]


def test_requests_that_stop_early_leave_no_work_filed_for_later_steps() -> None:
    # Each request has steps filed ahead (its block boundaries, its length limit); one that
    # stops first must not be touched at those steps while the others still decode.
    scheduler = make(num_blocks=64)
    short = [
        Sequence(i, [40 + i], SamplingParams(max_tokens=30, stop_token_ids=[9])) for i in range(3)
    ]
    long = Sequence(9, [50, 51], SamplingParams(max_tokens=20, ignore_eos=True))
    for seq in [*short, long]:
        scheduler.add(seq)

    def sample(token_ids: list[int]) -> int:
        # Request i stops at its (i + 2)-th token; the long one never does.
        return 9 if token_ids[0] in (40, 41, 42) and len(token_ids) == token_ids[0] - 37 else 1

    run_checked(scheduler, sample)  # type: ignore[arg-type]
    assert [s.num_completion_tokens for s in short] == [3, 4, 5]
    assert all(s.finish_reason is FinishReason.STOP for s in short)
    assert long.num_completion_tokens == 20 and long.finish_reason is FinishReason.LENGTH


def test_a_forking_plan_that_is_planned_again_forks_the_same_completions() -> None:
    scheduler = make()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    seqs = [Sequence(i, [1, 2, 3, 4, 5, 6], params) for i in range(3)]
    scheduler.add(seqs[0], forks=seqs[1:])
    first = scheduler.schedule()
    assert first is not None and first.forks == ((1, 1), (2, 2))
    # The plan never ran: the next schedule() takes the forks back and plans them again.
    again = scheduler.schedule()
    scheduler.check_integrity()
    assert again is not None and again.forks == first.forks
    # Slots are handed back and out again (maybe in another order), never shared.
    assert sorted(again.sample_slots.tolist()) == sorted(first.sample_slots.tolist()) == [0, 1, 2]
    for child in seqs[1:]:
        assert child.status is SequenceStatus.RUNNING
        assert (child.num_computed_tokens, child.num_cached_tokens) == (6, 0)
    scheduler.postprocess(again, [7, 8, 9])
    run_checked(scheduler, constant_sampler(5))
    assert [s.completion_token_ids for s in seqs] == [[7, 5, 5], [8, 5, 5], [9, 5, 5]]


def test_preemptions_are_counted_per_request() -> None:
    # A pool too small for four growing requests: the newest running one is preempted,
    # again and again (deterministic: the same counts every run).
    scheduler = make(num_blocks=10, block_size=4, max_model_len=40)
    seqs = [
        Sequence(i, [60 + i] * 6, SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(4)
    ]
    for seq in seqs:
        scheduler.add(seq)
    run_checked(scheduler, hash_sampler())
    counts = [seq.num_preemptions for seq in seqs]
    assert sum(counts) == scheduler.stats().num_preemptions
    assert counts == [0, 1, 2, 2]  # the newest requests twice each


@pytest.mark.parametrize(
    ("prompt_len", "num_blocks"),
    [
        (10, 5),  # 3 prompt blocks + a copy of the partial last block for each of 2 forks
        (12, 4),  # the prompt fills its blocks: the forks copy nothing, 3 blocks + 1 spare
    ],
)
def test_a_chunked_prompt_forks_at_its_last_chunk_when_the_blocks_just_fit(
    prompt_len: int, num_blocks: int
) -> None:
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks, block_size=4, max_model_len=16, max_num_batched_tokens=4
        )
    )
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    seqs = [Sequence(i, list(range(prompt_len)), params) for i in range(3)]
    scheduler.add(seqs[0], forks=seqs[1:])
    plans = []
    while scheduler.has_unfinished():
        result = step(scheduler, constant_sampler(7))
        assert result is not None
        scheduler.check_integrity()
        plans.append(result.plan)
    # Chunks of 4 tokens; the last one computes the rest of the prompt and forks at once.
    last = (prompt_len - 1) // 4
    assert [plan.query_lens.tolist() for plan in plans[: last + 1]] == [[4]] * last + [
        [prompt_len - 4 * last]
    ]
    assert [plan.forks for plan in plans[: last + 1]] == [()] * last + [((1, 1), (2, 2))]
    assert all(s.completion_token_ids == [7, 7] for s in seqs)
    assert scheduler.pool.num_free_blocks == num_blocks


@pytest.mark.parametrize(
    ("policy", "counts"),
    [
        # Two prompts at once, a third joining after two steps; max_tokens=4.
        ("mixed", (1, 4, 1)),
        ("prefill_first", (2, 4, 0)),
    ],
)
def test_steps_are_counted_by_what_they_hold(policy: str, counts: tuple[int, int, int]) -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=32, block_size=4, max_model_len=32, scheduling_policy=policy)
    )
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(2):
        scheduler.add(Sequence(i, [i + 1] * 5, params))
    for _ in range(2):
        assert step(scheduler, constant_sampler(3)) is not None
    scheduler.add(Sequence(2, [9] * 5, params))
    run_checked(scheduler, constant_sampler(3))
    stats = scheduler.stats()
    assert (stats.num_prefill_steps, stats.num_decode_steps, stats.num_mixed_steps) == counts


def test_unstarted_forks_are_listed_until_their_forking_step_is_recorded() -> None:
    scheduler = make()
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    seqs = [Sequence(i, [1, 2, 3, 4, 5], params) for i in range(3)]
    other = Sequence(5, [6, 7], params)
    scheduler.add(seqs[0], forks=seqs[1:])
    scheduler.add(other)
    assert scheduler.unstarted_forks(0) == seqs[1:]
    assert scheduler.unstarted_forks() == seqs[1:]
    assert scheduler.unstarted_forks(5) == [] and scheduler.unstarted_forks(99) == []
    plan = scheduler.schedule()  # forks them: in flight, not running on their own yet
    assert plan is not None and plan.forks == ((1, 1), (2, 2))
    assert scheduler.unstarted_forks(0) == seqs[1:]
    scheduler.postprocess(plan, [8] * plan.num_samples)
    assert scheduler.unstarted_forks(0) == [] and scheduler.unstarted_forks() == []


def test_a_parent_waiting_to_fork_decodes_on_its_own_once_its_forks_are_aborted() -> None:
    # B holds a block, so A's last prompt token cannot fork (it needs a block to grow and a
    # copy of its partial last block per fork): A stops one token short and waits. Aborting
    # its forks lets it compute that token as a plain request.
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=5, block_size=4, max_model_len=16, max_num_batched_tokens=4)
    )
    b = Sequence(9, [1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True))
    scheduler.add(b)
    assert step(scheduler, constant_sampler(4)) is not None
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    seqs = [Sequence(i, list(range(10)), params) for i in range(3)]
    scheduler.add(seqs[0], forks=seqs[1:])
    for _ in range(4):
        result = step(scheduler, constant_sampler(4))
        assert result is not None and result.plan.forks == ()
        scheduler.check_integrity()
    assert seqs[0].num_uncomputed_tokens == 1 and not seqs[0].decoding
    for child in seqs[1:]:
        assert scheduler.abort(child.seq_id)
    scheduler.check_integrity()
    assert seqs[0].decoding  # no fork left to wait for
    run_checked(scheduler, constant_sampler(4))
    assert seqs[0].completion_token_ids == [4, 4]
    assert [s.finish_reason for s in seqs] == [
        FinishReason.LENGTH,
        FinishReason.ABORT,
        FinishReason.ABORT,
    ]


def test_aborting_a_parent_before_it_forks_ends_its_completions_too() -> None:
    scheduler = make()
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    seqs = [Sequence(i, [1, 2, 3, 4, 5], params) for i in range(3)]
    scheduler.add(seqs[0], forks=seqs[1:])
    assert scheduler.abort(0)
    scheduler.check_integrity()
    assert [s.finish_reason for s in seqs] == [FinishReason.ABORT] * 3
    assert not scheduler.has_unfinished() and scheduler.unstarted_forks() == []
    assert scheduler.schedule() is None


def test_aborting_the_forks_of_a_parent_early_in_its_prompt_keeps_it_prefilling() -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=16, block_size=4, max_model_len=16, max_num_batched_tokens=4)
    )
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    seqs = [Sequence(i, list(range(10)), params) for i in range(3)]
    scheduler.add(seqs[0], forks=seqs[1:])
    assert step(scheduler, constant_sampler(4)) is not None  # the first chunk: 4 tokens
    for child in seqs[1:]:
        assert scheduler.abort(child.seq_id)
    scheduler.check_integrity()
    assert not seqs[0].decoding  # 6 prompt tokens left: still a prefill
    plans = []
    while scheduler.has_unfinished():
        result = step(scheduler, constant_sampler(4))
        assert result is not None
        scheduler.check_integrity()
        plans.append(result.plan)
    assert [plan.query_lens.tolist() for plan in plans] == [[4], [2], [1]]
    assert seqs[0].completion_token_ids == [4, 4]


def test_a_request_finishing_while_a_forks_block_copy_is_pending() -> None:
    # A's forks copy A's partial last block; the copy stays pending until a later plan
    # carries it. B finishes in the forking step itself, while the copy is pending.
    scheduler = make()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    a = [Sequence(i, [1, 2, 3, 4, 5, 6], params) for i in range(2)]
    b = Sequence(7, [8, 9, 10], SamplingParams(max_tokens=1))
    scheduler.add(a[0], forks=a[1:])
    scheduler.add(b)
    result = step(scheduler, constant_sampler(5))
    assert result is not None and result.plan.forks == ((1, 1),)
    assert b.finish_reason is FinishReason.LENGTH
    scheduler.check_integrity()
    copies = scheduler.pending_block_copies
    assert len(copies) == 1 and copies[0][1] == a[1].block_table[-1]
    # The next step is mixed (a new prompt beside the decode rows): it carries the copy.
    c = Sequence(8, [11, 12], SamplingParams(max_tokens=1))
    scheduler.add(c)
    result = step(scheduler, constant_sampler(5))
    assert result is not None and result.plan.is_mixed
    assert result.plan.block_copies == tuple(copies)
    assert scheduler.pending_block_copies == []  # recorded: the copy has run
    run_checked(scheduler, constant_sampler(5))
    assert [s.completion_token_ids for s in a] == [[5, 5, 5]] * 2
