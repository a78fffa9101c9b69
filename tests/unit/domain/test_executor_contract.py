"""The executor contract of pagedinfer.domain.executor: plan numbering and the recorded signal,
both ways to recover from a failed step, the n > 1 helper, and what is read-only."""

from __future__ import annotations

import pytest

from pagedinfer.domain import (
    BatchPlan,
    Executor,
    FinishReason,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
    StepOutput,
    completion_seed,
    make_forks,
)
from pagedinfer.domain.sampling import MAX_SEED

from .driver import hash_sampler


def make_scheduler(num_blocks: int = 32) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=8,  # prompts of 10 tokens arrive in chunks
            max_model_len=64,
            eos_token_ids=frozenset({0}),
        )
    )


class HistoryExecutor:
    """Samples a function of each sequence's history, and keeps per-request state that
    follows the sampled tokens (a count of tokens sampled), tentative until recorded."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.sampler = hash_sampler()
        self.counts: dict[int, int] = {}  # recorded
        self.tentative: dict[int, dict[int, int]] = {}  # step_id -> seq_id -> tokens

    def execute(self, plan: BatchPlan) -> StepOutput:
        for step_id in [s for s in self.tentative if s <= plan.recorded_step_id]:
            for seq_id, count in self.tentative.pop(step_id).items():
                self.counts[seq_id] = self.counts.get(seq_id, 0) + count
        self.tentative.clear()  # later ones were never recorded
        tokens = []
        mine: dict[int, int] = {}
        for seq_id in plan.sampled_seq_ids:
            seq = self.scheduler.get(seq_id)
            assert seq is not None
            tokens.append(self.sampler(seq.token_ids))
            mine[seq_id] = mine.get(seq_id, 0) + 1
        self.tentative[plan.step_id] = mine
        return StepOutput(tokens)


def requests() -> list[Sequence]:
    return [
        Sequence(i, [i + 1] * (3 + 4 * i), SamplingParams(max_tokens=6, ignore_eos=True))
        for i in range(3)
    ]


def run(scheduler: Scheduler, executor: Executor, fail_at: set[int], style: str) -> list[int]:
    """Run to the end; steps numbered in ``fail_at`` fail once after executing. Returns the
    step ids of the plans run."""
    ran: list[int] = []
    attempt = 0
    plan = scheduler.schedule()
    while plan is not None:
        attempt += 1
        output = executor.execute(plan)
        ran.append(plan.step_id)
        if attempt in fail_at:  # the step "failed" after the executor ran it
            if style == "rerun":
                continue  # run the same plan again
            plan = scheduler.schedule()
            continue
        scheduler.postprocess(plan, output.sampled_token_ids)
        plan = scheduler.schedule()
    return ran


def completions(seqs: list[Sequence]) -> list[list[int]]:
    return [seq.completion_token_ids for seq in seqs]


@pytest.mark.parametrize("style", ["schedule_again", "rerun"])
def test_a_failed_step_recovers_both_ways_and_tentative_state_follows_the_signal(
    style: str,
) -> None:
    reference = make_scheduler()
    expected = requests()
    for seq in expected:
        reference.add(seq)
    run(reference, HistoryExecutor(reference), set(), style)

    scheduler = make_scheduler()
    seqs = requests()
    for seq in seqs:
        scheduler.add(seq)
    executor = HistoryExecutor(scheduler)
    ran = run(scheduler, executor, {2, 3, 7}, style)
    assert completions(seqs) == completions(expected)
    assert all(seq.finish_reason is FinishReason.LENGTH for seq in seqs)
    # Plans are numbered one per schedule() call that returned a plan; a re-run repeats one.
    if style == "rerun":
        assert ran.count(ran[1]) == 3 and ran.count(ran[6]) == 2  # failed twice in a row, once
    else:
        assert ran == list(range(1, len(ran) + 1))
    # Only recorded plans' tokens were kept: one per completion token, none twice.
    plan = scheduler.schedule()
    assert plan is None
    for counts in executor.tentative.values():  # the last plan was recorded
        for seq_id, count in counts.items():
            executor.counts[seq_id] = executor.counts.get(seq_id, 0) + count
    assert executor.counts == {seq.seq_id: 6 for seq in seqs}


def test_recorded_step_id_names_the_latest_recorded_plan() -> None:
    scheduler = make_scheduler()
    scheduler.add(Sequence(0, [1, 2, 3], SamplingParams(max_tokens=5)))
    first = scheduler.schedule()
    assert first is not None and (first.step_id, first.recorded_step_id) == (1, 0)
    scheduler.postprocess(first, [7])
    failed = scheduler.schedule()
    assert failed is not None and (failed.step_id, failed.recorded_step_id) == (2, 1)
    again = scheduler.schedule()  # the failed plan is never recorded
    assert again is not None and (again.step_id, again.recorded_step_id) == (3, 1)
    with pytest.raises(ValueError, match="latest schedule"):
        scheduler.postprocess(failed, [7])
    with pytest.raises(ValueError, match="one token id per sampled row"):
        scheduler.postprocess(again, [])
    scheduler.postprocess(again, [7])  # a refused call recorded nothing
    after = scheduler.schedule()
    assert after is not None and after.recorded_step_id == 3


def test_make_forks_numbers_and_seeds_completions_as_the_engine_does() -> None:
    params = SamplingParams(n=3, seed=MAX_SEED - 1, max_tokens=4)
    first = Sequence(10, [1, 2, 3], params, extra_key=77)
    forks = make_forks(first)
    assert [fork.seq_id for fork in forks] == [11, 12]
    assert [fork.params.seed for fork in forks] == [MAX_SEED, 0]  # wraps within 63 bits
    assert all(fork.prompt_token_ids == [1, 2, 3] and fork.extra_key == 77 for fork in forks)
    assert all(fork.params.n == 3 and fork.params.max_tokens == 4 for fork in forks)
    assert [fork.seq_id for fork in make_forks(first, first_id=100)] == [100, 101]
    unseeded = make_forks(Sequence(0, [1], SamplingParams(n=2)))
    assert [fork.params.seed for fork in unseeded] == [None]
    assert make_forks(Sequence(0, [1], SamplingParams())) == []
    assert completion_seed(None, 3) is None and completion_seed(5, 2) == 7


def test_queues_are_copies_that_cannot_change_the_scheduler() -> None:
    scheduler = make_scheduler()
    for seq in requests():
        scheduler.add(seq)
    waiting = scheduler.waiting
    waiting.clear()
    assert [seq.seq_id for seq in scheduler.waiting] == [0, 1, 2]
    plan = scheduler.schedule()
    assert plan is not None
    running = scheduler.running
    running.pop()
    assert len(scheduler.running) == len(running) + 1
    scheduler.check_integrity()
