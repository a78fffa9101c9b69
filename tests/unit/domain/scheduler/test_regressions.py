"""Bugs the test suites found in the domain layer, pinned as plain tests.

Each test names the bug it guards against; keep them even when they look redundant.
"""

from __future__ import annotations

from pagedinfer.domain import (
    BlockPool,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
    chain_hashes,
)

from ..driver import constant_sampler, hash_sampler, run_to_completion


def test_extra_key_zero_does_not_share_kv_with_no_key() -> None:
    # Bug: extra_key only seeded xxh64, and seed 0 is the default, so extra_key=0 (say,
    # adapter id 0) produced the same chain as no key and shared KV with the base model.
    tokens = [7, 8, 9, 10]
    assert chain_hashes(tokens, 4, extra_key=0) != chain_hashes(tokens, 4)
    pool = BlockPool(2, 4)
    (block,) = pool.allocate(1)
    (digest,) = chain_hashes(tokens, 4)
    pool.register(block.block_id, digest, None, tokens)
    assert pool.find_cached_prefix(chain_hashes(tokens, 4, extra_key=0), tokens) == []


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
