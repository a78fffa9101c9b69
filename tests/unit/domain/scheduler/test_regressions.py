"""Bugs the test suites found in the scheduler, pinned as plain tests.

Each test names the bug it guards against; keep them even when they look redundant.
"""

from __future__ import annotations

from pagedinfer.domain import SamplingParams, Scheduler, SchedulerConfig, Sequence

from ..driver import constant_sampler, hash_sampler, run_to_completion


def test_num_cached_tokens_counts_prompt_tokens_found_at_first_admission() -> None:
    # Bug (shrunk by test_scheduler_machine): preemption reset num_cached_tokens and
    # re-admission set it to the request's hits on its *own* earlier blocks, so a one-token
    # prompt reported 2 cached tokens. It must count prompt tokens served by the prefix cache
    # when the request was first admitted.
    config = SchedulerConfig(
        num_blocks=5,
        block_size=1,
        max_num_seqs=2,
        max_num_batched_tokens=2,
        max_model_len=5,
        eos_token_ids=frozenset({0}),
    )
    scheduler = Scheduler(config)
    seqs = [Sequence(i, [3], SamplingParams(max_tokens=3)) for i in range(2)]
    for seq in seqs:
        scheduler.add(seq)
    run_to_completion(scheduler, hash_sampler(vocab=40))
    assert scheduler.stats().num_preemptions == 1
    assert [seq.num_cached_tokens for seq in seqs] == [0, 0]
    assert [seq.num_preemptions for seq in seqs] == [0, 1]  # the newer one was preempted


def test_num_cached_tokens_survives_preemption() -> None:
    # The other half of the same bug: a request that did hit the cache kept reporting the
    # hits of its last admission, 0 if its blocks were evicted in between.
    scheduler = Scheduler(SchedulerConfig(num_blocks=4, block_size=2, max_model_len=8))
    first = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=1))
    scheduler.add(first)
    run_to_completion(scheduler, constant_sampler(9))
    a = Sequence(1, [7, 7, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    b = Sequence(2, [1, 2, 4], SamplingParams(max_tokens=4, ignore_eos=True))
    scheduler.add(a)
    scheduler.add(b)
    run_to_completion(scheduler, constant_sampler(9))
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert b.num_cached_tokens == 2  # block [1, 2] was served by the cache at admission
