"""Scheduler: admission, chunked prefill, decode, preemption, finishing and aborting.

Driven with a fake sampler (see ``driver.py``): no model, no GPU.
"""

from __future__ import annotations

import dataclasses

import pytest

from pagedinfer.domain import (
    BatchPlan,
    BlockPool,
    FinishReason,
    SamplingParams,
    ScheduledChunk,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
    build_batch_plan,
    chain_hashes,
)
from pagedinfer.errors import ConfigurationError, InvalidRequestError

from ..driver import constant_sampler, hash_sampler, run_to_completion, step

LONG = SamplingParams(max_tokens=1000, ignore_eos=True)


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 64,
    enable_prefix_caching: bool = True,
    eos: frozenset[int] = frozenset(),
    pool: BlockPool | None = None,
    policy: str = "mixed",
) -> Scheduler:
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        eos_token_ids=eos,
        scheduling_policy=policy,
    )
    return Scheduler(config, pool)


def prompt(seq_id: int, length: int) -> list[int]:
    return [100 * (seq_id + 1) + i for i in range(length)]


def add(
    scheduler: Scheduler, seq_id: int, tokens: list[int], params: SamplingParams = LONG
) -> Sequence:
    seq = Sequence(seq_id, tokens, params)
    scheduler.add(seq)
    return seq


def assert_all_free(scheduler: Scheduler) -> None:
    pool = scheduler.pool
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
    assert all(pool.block(i).ref_count == 0 for i in range(pool.num_blocks))


def reference_completions(
    prompts: dict[int, list[int]], params: SamplingParams, max_model_len: int, vocab: int = 1000
) -> dict[int, list[int]]:
    """Completions from an unconstrained scheduler: one step prefills everything."""
    scheduler = make(num_blocks=1024, max_model_len=max_model_len, max_num_batched_tokens=100_000)
    seqs = {seq_id: add(scheduler, seq_id, tokens, params) for seq_id, tokens in prompts.items()}
    run_to_completion(scheduler, hash_sampler(vocab))
    return {seq_id: seq.completion_token_ids for seq_id, seq in seqs.items()}


# ------------------------------------------------------------------------------- config
def test_config_refuses_a_pool_smaller_than_one_max_model_len_sequence() -> None:
    with pytest.raises(ConfigurationError) as excinfo:
        SchedulerConfig(num_blocks=4, block_size=16, max_model_len=65)
    message = str(excinfo.value)
    assert "64 tokens" in message and "max_model_len is 65" in message
    assert isinstance(excinfo.value, ValueError)
    SchedulerConfig(num_blocks=4, block_size=16, max_model_len=64)  # exactly enough


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_blocks": 0},
        {"block_size": 0},
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"max_num_seqs": True},
        {"block_size": 2.0},
        {"max_model_len": 1},
        {"max_model_len": 8.0},
    ],
)
def test_config_refuses_bad_numbers(kwargs: dict[str, object]) -> None:
    values: dict[str, object] = {"num_blocks": 64, "block_size": 4, "max_model_len": 16}
    values.update(kwargs)
    with pytest.raises(ConfigurationError) as excinfo:
        SchedulerConfig(**values)  # type: ignore[arg-type]
    assert next(iter(kwargs)) in str(excinfo.value)


def test_token_budget_may_be_smaller_than_max_model_len() -> None:
    config = SchedulerConfig(
        num_blocks=64, block_size=4, max_num_batched_tokens=8, max_model_len=64
    )
    assert config.max_num_batched_tokens < config.max_model_len


def test_a_mismatched_pool_is_refused() -> None:
    config = SchedulerConfig(num_blocks=8, block_size=4, max_model_len=16)
    with pytest.raises(ConfigurationError, match="block pool does not match the scheduler config"):
        Scheduler(config, BlockPool(8, 2))
    with pytest.raises(ConfigurationError, match="block pool does not match the scheduler config"):
        Scheduler(config, BlockPool(9, 4))


# ---------------------------------------------------------------------------------- add
def test_empty_prompt_is_rejected() -> None:
    scheduler = make()
    with pytest.raises(InvalidRequestError, match="empty"):
        scheduler.add(Sequence(0, []))
    assert not scheduler.has_unfinished()


def test_prompt_that_can_never_fit_is_rejected_with_both_numbers() -> None:
    scheduler = make(max_model_len=16)
    with pytest.raises(InvalidRequestError) as excinfo:
        scheduler.add(Sequence(0, prompt(0, 16)))
    assert "16 tokens" in str(excinfo.value) and "max_model_len=16" in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert not scheduler.has_unfinished()
    scheduler.add(Sequence(1, prompt(1, 15)))  # prompt + 1 == max_model_len is fine
    assert scheduler.num_unfinished == 1


def test_duplicate_or_reused_requests_are_rejected() -> None:
    scheduler = make()
    seq = add(scheduler, 0, prompt(0, 3))
    with pytest.raises(InvalidRequestError, match="already"):
        scheduler.add(Sequence(0, prompt(1, 3)))
    step(scheduler, constant_sampler(1))
    with pytest.raises(InvalidRequestError, match="request id 0 is already queued or running"):
        scheduler.add(seq)
    assert scheduler.num_unfinished == 1


def test_get_and_unfinished() -> None:
    scheduler = make()
    seq = add(scheduler, 5, prompt(0, 3))
    assert scheduler.get(5) is seq
    assert scheduler.get(6) is None
    assert scheduler.has_unfinished()
    assert scheduler.schedule() is not None


def test_nothing_to_do_gives_no_plan() -> None:
    assert make().schedule() is None


# -------------------------------------------------------------------------------- prefill
def test_prefill_admits_in_arrival_order_and_allocates_blocks() -> None:
    scheduler = make()
    a = add(scheduler, 0, prompt(0, 5))
    b = add(scheduler, 1, prompt(1, 3))
    c = add(scheduler, 2, prompt(2, 8))
    plan = scheduler.schedule()
    assert plan is not None and plan.is_prefill
    assert plan.seq_ids.tolist() == [0, 1, 2]
    assert plan.query_lens.tolist() == [5, 3, 8]
    assert a.block_table == [0, 1]
    assert b.block_table == [2]
    assert c.block_table == [3, 4]
    assert plan.sampled_seq_ids == [0, 1, 2]
    assert [s.status for s in (a, b, c)] == [SequenceStatus.RUNNING] * 3
    assert list(scheduler.running) == [a, b, c]
    assert not scheduler.waiting


def test_prefill_goes_before_decode_under_the_prefill_first_policy() -> None:
    scheduler = make(policy="prefill_first")
    add(scheduler, 0, prompt(0, 5))
    add(scheduler, 1, prompt(1, 3))
    sampler = constant_sampler(7)
    step(scheduler, sampler)
    add(scheduler, 2, prompt(2, 6))
    result = step(scheduler, sampler)
    assert result is not None
    assert result.plan.is_prefill and result.plan.seq_ids.tolist() == [2]
    result = step(scheduler, sampler)
    assert result is not None
    assert not result.plan.is_prefill and result.plan.seq_ids.tolist() == [0, 1, 2]
    stats = scheduler.stats()
    assert (stats.num_prefill_steps, stats.num_decode_steps, stats.num_mixed_steps) == (2, 1, 0)


def test_admission_is_strictly_first_come_first_served() -> None:
    # The head of the queue does not fit; a smaller later request must not overtake it.
    scheduler = make(num_blocks=4, block_size=4, max_model_len=16)
    add(scheduler, 0, prompt(0, 9))  # 3 blocks
    step(scheduler, constant_sampler(7))
    add(scheduler, 1, prompt(1, 8))  # needs 2 blocks, only 1 is free
    add(scheduler, 2, prompt(2, 2))  # would fit in the free block
    result = step(scheduler, constant_sampler(7))
    assert result is not None
    assert not result.plan.is_prefill and result.plan.seq_ids.tolist() == [0]
    assert [s.seq_id for s in scheduler.waiting] == [1, 2]


def test_max_num_seqs_limits_admission() -> None:
    scheduler = make(max_num_seqs=2)
    for seq_id in range(3):
        add(scheduler, seq_id, prompt(seq_id, 3), SamplingParams(max_tokens=2))
    sampler = constant_sampler(7)
    plans = run_to_completion(scheduler, sampler)
    assert plans[0].seq_ids.tolist() == [0, 1]
    assert all(plan.num_seqs <= 2 for plan in plans)
    assert 2 in plans[2].seq_ids  # admitted once 0 and 1 finished


def test_token_budget_limits_the_number_of_running_sequences() -> None:
    # A decode step must hold every running sequence, so a budget of 2 tokens means at
    # most 2 running sequences even with a larger max_num_seqs.
    scheduler = make(max_num_seqs=8, max_num_batched_tokens=2)
    for seq_id in range(4):
        add(scheduler, seq_id, prompt(seq_id, 1), SamplingParams(max_tokens=3))
    plans = run_to_completion(scheduler, constant_sampler(7))
    assert all(plan.num_tokens <= 2 and plan.num_seqs <= 2 for plan in plans)


def test_token_budget_counts_only_uncached_tokens() -> None:
    shared = prompt(0, 8)
    for caching, expected_seq_ids in ((True, [1, 2]), (False, [1])):
        scheduler = make(max_num_batched_tokens=8, enable_prefix_caching=caching)
        add(scheduler, 0, shared, SamplingParams(max_tokens=1))
        run_to_completion(scheduler, constant_sampler(7))
        b = add(scheduler, 1, [*shared, *prompt(1, 4)])
        add(scheduler, 2, prompt(2, 4))
        plan = scheduler.schedule()
        assert plan is not None
        assert plan.seq_ids.tolist() == expected_seq_ids
        assert plan.num_tokens == 8
        if caching:
            assert b.num_cached_tokens == 8
            assert plan.query_lens.tolist() == [4, 4]
            assert plan.positions[:4].tolist() == [8, 9, 10, 11]
            stats = scheduler.pool.stats()
            assert stats.prefix_query_tokens == 8 + 12 + 4
            assert stats.prefix_hit_tokens == 8
        else:
            assert b.num_cached_tokens == 0


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_admission_counts_hits_on_blocks_in_use_as_free(policy: str) -> None:
    # 4 blocks; a holds 3. b shares a's first two blocks and needs just one more: it fits.
    scheduler = make(num_blocks=4, block_size=4, max_model_len=16, policy=policy)
    a = add(scheduler, 0, prompt(0, 9))
    sampler = constant_sampler(7)
    step(scheduler, sampler)
    assert scheduler.pool.num_free_blocks == 1
    b = add(scheduler, 1, [*prompt(0, 8), 5])
    result = step(scheduler, sampler)
    # Under the mixed policy a decodes in the same step (its token still fits in block 2).
    expected = [0, 1] if policy == "mixed" else [1]
    assert result is not None and result.plan.seq_ids.tolist() == expected
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_cached_tokens == 8 and result.plan.query_lens.tolist()[-1] == 1
    assert scheduler.pool.num_free_blocks == 0


def test_admission_pays_for_resurrecting_free_cached_blocks() -> None:
    # The hits sit on the free list: taking them costs free blocks, so c must wait.
    scheduler = make(num_blocks=4, block_size=4, max_model_len=16)
    sampler = constant_sampler(7)
    add(scheduler, 0, prompt(0, 8), SamplingParams(max_tokens=1))
    run_to_completion(scheduler, sampler)  # blocks 0 and 1 free but cached
    add(scheduler, 1, prompt(1, 8))  # takes blocks 2 and 3
    step(scheduler, sampler)
    c = add(scheduler, 2, [*prompt(0, 8), 5])  # 2 free cached hits + 1 new block > 2 free
    result = step(scheduler, sampler)
    assert result is not None and result.plan.seq_ids.tolist() == [1]  # a decode step instead
    assert c.status is SequenceStatus.WAITING


def test_full_prompt_hit_still_recomputes_the_last_block() -> None:
    scheduler = make()
    tokens = prompt(0, 8)
    a = add(scheduler, 0, tokens, SamplingParams(max_tokens=1))
    step(scheduler, constant_sampler(7))
    first_blocks = [0, 1]
    assert a.is_finished
    b = add(scheduler, 1, tokens)
    plan = scheduler.schedule()
    assert plan is not None
    assert b.num_cached_tokens == 4
    assert plan.positions.tolist() == [4, 5, 6, 7]
    assert plan.sample_indices.tolist() == [3]
    assert b.block_table[0] == first_blocks[0]
    assert b.block_table[1] != first_blocks[1]  # a fresh copy, never a write into a shared block
    scheduler.postprocess(plan, [7])
    assert scheduler.pool.stats().num_cached_blocks == 3  # two copies of the second block
    scheduler.pool.check_integrity()


def test_requests_with_different_extra_keys_never_share_blocks() -> None:
    scheduler = make()
    tokens = prompt(0, 12)
    sampler = constant_sampler(7)
    add(scheduler, 0, tokens, SamplingParams(max_tokens=1))
    run_to_completion(scheduler, sampler)
    salted = Sequence(1, tokens, SamplingParams(max_tokens=1), extra_key=0)
    scheduler.add(salted)
    run_to_completion(scheduler, sampler)
    assert salted.num_cached_tokens == 0
    again = Sequence(2, tokens, SamplingParams(max_tokens=1), extra_key=0)
    plain = Sequence(3, tokens, SamplingParams(max_tokens=1))
    scheduler.add(again)
    scheduler.add(plain)
    run_to_completion(scheduler, sampler)
    assert again.num_cached_tokens == 8  # shares with the request of the same key
    assert plain.num_cached_tokens == 8  # and the plain one with the first request


def test_one_token_prompt() -> None:
    scheduler = make(max_model_len=8)
    seq = add(scheduler, 0, [42], SamplingParams(max_tokens=3))
    plans = run_to_completion(scheduler, constant_sampler(7))
    assert plans[0].is_prefill and plans[0].query_lens.tolist() == [1]
    assert seq.completion_token_ids == [7, 7, 7]
    assert_all_free(scheduler)


# -------------------------------------------------------------------------- chunked prefill
def test_long_prompt_is_prefilled_in_chunks() -> None:
    scheduler = make(num_blocks=8, max_num_batched_tokens=4, max_model_len=16)
    seq = add(scheduler, 0, prompt(0, 10))
    sampler = constant_sampler(7)
    chunks = []
    for _ in range(3):
        result = step(scheduler, sampler)
        assert result is not None
        chunks.append(result.plan)
    assert [p.positions.tolist() for p in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(p.is_prefill for p in chunks)
    assert [p.sample_indices.tolist() for p in chunks] == [[], [], [1]]
    assert [p.context_lens.tolist() for p in chunks] == [[4], [8], [10]]
    assert [p.block_tables.tolist() for p in chunks] == [[0], [0, 1], [0, 1, 2]]
    assert seq.completion_token_ids == [7]
    result = step(scheduler, sampler)
    assert result is not None
    assert not result.plan.is_prefill and result.plan.positions.tolist() == [10]


def test_chunks_share_the_budget_with_new_requests() -> None:
    scheduler = make(max_num_batched_tokens=4)
    add(scheduler, 0, prompt(0, 6))
    add(scheduler, 1, prompt(1, 2))
    sampler = constant_sampler(7)
    first = step(scheduler, sampler)
    second = step(scheduler, sampler)
    assert first is not None and second is not None
    assert (first.plan.seq_ids.tolist(), first.plan.query_lens.tolist()) == ([0], [4])
    assert (second.plan.seq_ids.tolist(), second.plan.query_lens.tolist()) == ([0, 1], [2, 2])
    assert second.plan.sampled_seq_ids == [0, 1]


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_chunked_prefill_output_equals_a_single_prefill(policy: str) -> None:
    prompts = {0: prompt(0, 23), 1: prompt(1, 5)}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = reference_completions(prompts, params, max_model_len=64)
    scheduler = make(max_num_batched_tokens=3, block_size=2, policy=policy)
    seqs = [add(scheduler, i, tokens, params) for i, tokens in prompts.items()]
    run_to_completion(scheduler, hash_sampler())
    assert {s.seq_id: s.completion_token_ids for s in seqs} == expected


# ---------------------------------------------------------------------------------- decode
def test_decode_gives_every_running_sequence_one_token() -> None:
    scheduler = make(block_size=4)
    a = add(scheduler, 0, prompt(0, 4))
    b = add(scheduler, 1, prompt(1, 2))
    sampler = constant_sampler(7)
    step(scheduler, sampler)
    result = step(scheduler, sampler)
    assert result is not None
    plan = result.plan
    assert not plan.is_prefill
    assert plan.query_lens.tolist() == [1, 1]
    assert plan.positions.tolist() == [4, 2]
    assert a.block_table == [0, 2]  # position 4 opened a new block
    assert plan.slot_mapping.tolist() == [2 * 4 + 0, 1 * 4 + 2]
    assert plan.input_ids.tolist() == [7, 7]
    assert plan.sampled_seq_ids == [0, 1]
    assert [s.num_computed_tokens for s in (a, b)] == [5, 3]
    assert [s.num_tokens for s in (a, b)] == [6, 4]


# ------------------------------------------------------------------------------ preemption
def test_preemption_takes_the_newest_and_puts_it_at_the_front_of_waiting() -> None:
    scheduler = make(num_blocks=4, block_size=2, max_model_len=8)
    a = add(scheduler, 0, [1, 2, 3])
    b = add(scheduler, 1, [4, 5, 6])
    sampler = constant_sampler(9)
    step(scheduler, sampler)  # prefill: a -> [0, 1], b -> [2, 3]
    c = add(scheduler, 2, [7])
    step(scheduler, sampler)  # decode both; c does not fit
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    result = step(scheduler, sampler)  # a needs a third block: b is preempted
    assert result is not None
    assert result.plan.seq_ids.tolist() == [0]
    assert list(scheduler.waiting) == [b, c]
    assert b.status is SequenceStatus.WAITING
    assert (b.block_table, b.num_computed_tokens, b.num_cached_tokens) == ([], 0, 0)
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 0)
    assert b.token_ids == [4, 5, 6, 9, 9]  # the generated tokens are kept for recompute
    # b freed its tail first, so a took block 3 and b's head block 2 stays cached.
    assert a.block_table == [0, 1, 3]
    head = chain_hashes(b.token_ids, 2)[:1]
    assert [blk.block_id for blk in scheduler.pool.find_cached_prefix(head, b.token_ids)] == [2]
    assert scheduler.stats().num_preemptions == 1
    scheduler.pool.check_integrity()


def test_preemption_spares_older_sequences() -> None:
    # Three sequences fill the pool; the oldest needs a block: the newest gives its blocks
    # up, not the middle one.
    scheduler = make(num_blocks=6, block_size=2, max_model_len=12)
    a, b, c = (add(scheduler, i, prompt(i, 3)) for i in range(3))
    sampler = constant_sampler(9)
    step(scheduler, sampler)  # prefill: two blocks each
    step(scheduler, sampler)  # decode position 3: still two blocks each
    result = step(scheduler, sampler)  # position 4 needs a third block for a and b
    assert result is not None
    assert result.plan.seq_ids.tolist() == [0, 1]
    assert list(scheduler.waiting) == [c]
    assert len(a.block_table) == len(b.block_table) == 3
    assert c.block_table == []


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_preempted_sequences_finish_with_the_reference_tokens(policy: str) -> None:
    prompts = {i: prompt(i, 3 + i) for i in range(4)}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = reference_completions(prompts, params, max_model_len=24)
    scheduler = make(num_blocks=6, block_size=4, max_model_len=24, policy=policy)
    seqs = [add(scheduler, i, tokens, params) for i, tokens in prompts.items()]
    run_to_completion(scheduler, hash_sampler())
    assert scheduler.stats().num_preemptions == 4  # deterministic, the same for both policies
    assert {s.seq_id: s.completion_token_ids for s in seqs} == expected
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert_all_free(scheduler)


def test_a_lone_sequence_that_cannot_grow_preempts_itself_without_raising() -> None:
    pool = BlockPool(4, 2)
    scheduler = make(num_blocks=4, block_size=2, max_model_len=8, pool=pool)
    held = [block.block_id for block in pool.allocate(2)]  # someone else holds half the pool
    seq = add(scheduler, 0, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    sampler = constant_sampler(9)
    step(scheduler, sampler)  # prefill into 2 blocks
    step(scheduler, sampler)  # decode position 3, still in block 2
    assert scheduler.schedule() is None  # position 4 needs a third block: none anywhere
    assert seq.status is SequenceStatus.WAITING
    assert seq.block_table == []
    assert scheduler.stats().num_preemptions == 1
    assert scheduler.schedule() is None  # still stuck, still no exception
    pool.free(held)
    run_to_completion(scheduler, sampler)
    assert seq.completion_token_ids == [9, 9, 9, 9]
    assert_all_free(scheduler)


def test_stuck_partial_prefills_free_the_newest() -> None:
    # Two chunked prefills hold the whole pool and neither can grow: the newest is
    # preempted so that the older one finishes its prompt.
    pool = BlockPool(8, 1)
    scheduler = make(
        num_blocks=8, block_size=1, max_num_batched_tokens=3, max_model_len=8, pool=pool
    )
    a = add(scheduler, 0, prompt(0, 5), SamplingParams(max_tokens=1))
    b = add(scheduler, 1, prompt(1, 5), SamplingParams(max_tokens=1))
    sampler = constant_sampler(7)
    step(scheduler, sampler)  # a: 3 tokens
    result = step(scheduler, sampler)  # a: 2 more (done), b: 1
    assert result is not None and result.plan.seq_ids.tolist() == [0, 1]
    assert a.is_finished
    held = pool.allocate(pool.num_free_blocks)  # starve b
    c = add(scheduler, 2, prompt(2, 5), SamplingParams(max_tokens=1))
    assert scheduler.schedule() is None
    assert b.status is SequenceStatus.WAITING and list(scheduler.waiting) == [b, c]
    pool.free([block.block_id for block in held])
    run_to_completion(scheduler, sampler)
    assert b.is_finished and c.is_finished
    assert_all_free(scheduler)


# ------------------------------------------------------------------------- finish rules
def run_one(scheduler: Scheduler, params: SamplingParams, token: int, length: int = 3) -> Sequence:
    seq = add(scheduler, 0, prompt(0, length), params)
    run_to_completion(scheduler, constant_sampler(token))
    assert_all_free(scheduler)
    return seq


def test_eos_finishes_with_stop_and_the_token_is_kept() -> None:
    seq = run_one(make(eos=frozenset({2})), SamplingParams(max_tokens=5), token=2)
    assert seq.finish_reason is FinishReason.STOP
    assert seq.completion_token_ids == [2]
    assert seq.is_finished


def test_ignore_eos_runs_to_max_tokens() -> None:
    seq = run_one(make(eos=frozenset({2})), SamplingParams(max_tokens=5, ignore_eos=True), 2)
    assert seq.finish_reason is FinishReason.LENGTH
    assert seq.completion_token_ids == [2] * 5


def test_stop_token_ids_finish_even_with_ignore_eos() -> None:
    params = SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=(3,))
    seq = run_one(make(eos=frozenset({2})), params, token=3)
    assert seq.finish_reason is FinishReason.STOP
    assert seq.completion_token_ids == [3]


def test_max_tokens_finishes_with_length() -> None:
    seq = run_one(make(), SamplingParams(max_tokens=4), token=5)
    assert seq.finish_reason is FinishReason.LENGTH
    assert seq.num_completion_tokens == 4


def test_max_model_len_finishes_with_length() -> None:
    seq = run_one(make(max_model_len=10), SamplingParams(max_tokens=100), token=5, length=7)
    assert seq.finish_reason is FinishReason.LENGTH
    assert seq.num_tokens == 10


def test_postprocess_returns_every_sequence_that_got_a_token() -> None:
    scheduler = make()
    a = add(scheduler, 0, prompt(0, 3), SamplingParams(max_tokens=1))
    b = add(scheduler, 1, prompt(1, 3), SamplingParams(max_tokens=2))
    result = step(scheduler, constant_sampler(5))
    assert result is not None
    assert result.updated == [a, b]
    assert a.is_finished and not b.is_finished
    assert scheduler.num_unfinished == 1
    assert scheduler.get(0) is None


def test_postprocess_rejects_a_wrong_number_of_samples() -> None:
    scheduler = make()
    add(scheduler, 0, prompt(0, 3))
    plan = scheduler.schedule()
    assert plan is not None
    with pytest.raises(ValueError, match="0 sampled token ids for a plan that samples 1 rows"):
        scheduler.postprocess(plan, [])


# ------------------------------------------------------------------------ finish / abort
def test_abort_a_waiting_request() -> None:
    scheduler = make()
    seq = add(scheduler, 0, prompt(0, 3))
    assert scheduler.abort(0)
    assert seq.finish_reason is FinishReason.ABORT and seq.is_finished
    assert not scheduler.has_unfinished() and not scheduler.waiting
    assert scheduler.schedule() is None


def test_abort_during_chunked_prefill_frees_its_blocks() -> None:
    scheduler = make(max_num_batched_tokens=4)
    seq = add(scheduler, 0, prompt(0, 10))
    step(scheduler, constant_sampler(7))
    assert seq.block_table == [0]
    assert scheduler.abort(0)
    assert not scheduler.running
    assert_all_free(scheduler)


def test_abort_a_decoding_request_with_shared_blocks() -> None:
    scheduler = make()
    shared = prompt(0, 8)
    a = add(scheduler, 0, [*shared, 1])
    b = add(scheduler, 1, [*shared, 2])  # same step: computes its own copy of the prefix
    sampler = constant_sampler(7)
    step(scheduler, sampler)
    step(scheduler, sampler)  # both decoding
    c = add(scheduler, 2, [*shared, 3])
    step(scheduler, sampler)
    assert c.num_cached_tokens == 8
    shared_blocks = c.block_table[:2]
    assert shared_blocks in (a.block_table[:2], b.block_table[:2])
    assert [scheduler.pool.block(i).ref_count for i in shared_blocks] == [2, 2]
    assert scheduler.abort(0)
    assert scheduler.abort(2)
    assert b.status is SequenceStatus.RUNNING
    assert all(scheduler.pool.block(i).ref_count == 1 for i in b.block_table)
    assert scheduler.abort(1)
    assert_all_free(scheduler)


def test_abort_a_preempted_request() -> None:
    scheduler = make(num_blocks=4, block_size=2, max_model_len=8)
    add(scheduler, 0, [1, 2, 3])
    b = add(scheduler, 1, [4, 5, 6])
    sampler = constant_sampler(9)
    for _ in range(3):
        step(scheduler, sampler)
    assert b.status is SequenceStatus.WAITING  # preempted
    assert scheduler.abort(1)
    assert b.finish_reason is FinishReason.ABORT
    assert scheduler.abort(0)
    assert_all_free(scheduler)


def test_abort_unknown_or_finished_returns_false() -> None:
    scheduler = make()
    seq = add(scheduler, 0, prompt(0, 3), SamplingParams(max_tokens=1))
    run_to_completion(scheduler, constant_sampler(7))
    assert not scheduler.abort(0)
    assert seq.finish_reason is FinishReason.LENGTH  # not overwritten
    assert not scheduler.abort(123)


def test_abort_between_schedule_and_postprocess() -> None:
    scheduler = make()
    a = add(scheduler, 0, prompt(0, 3))
    b = add(scheduler, 1, prompt(1, 3))
    plan = scheduler.schedule()
    assert plan is not None
    scheduler.abort(0)
    updated = scheduler.postprocess(plan, [7, 7])
    assert updated == [b]
    assert a.token_ids == prompt(0, 3)
    assert b.completion_token_ids == [7]
    scheduler.abort(1)
    assert_all_free(scheduler)


def test_finish_stops_a_request_with_the_given_reason() -> None:
    scheduler = make()
    seq = add(scheduler, 0, prompt(0, 3))
    step(scheduler, constant_sampler(7))
    assert scheduler.finish(0, FinishReason.STOP) is seq
    assert seq.finish_reason is FinishReason.STOP
    assert scheduler.finish(0, FinishReason.STOP) is None
    assert_all_free(scheduler)


# ------------------------------------------------------------------------------- fairness
@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_no_waiting_request_starves_under_a_stream_of_new_ones(policy: str) -> None:
    scheduler = make(num_blocks=8, block_size=4, max_num_seqs=2, max_model_len=32, policy=policy)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    seqs = [add(scheduler, i, prompt(i, 6 + 5 * (i % 3)), params) for i in range(3)]
    sampler = hash_sampler()
    next_id = 3
    for _ in range(60):
        seqs.append(add(scheduler, next_id, prompt(next_id, 3), params))
        next_id += 1
        step(scheduler, sampler)
    # Requests finish in arrival order, so everything added early is done by now.
    assert all(seq.is_finished for seq in seqs[:20])
    finished = [seq.seq_id for seq in seqs if seq.is_finished]
    assert finished == list(range(len(finished)))


# ----------------------------------------------------------- duplicate prefixes in one step
def test_two_sequences_with_the_same_new_prefix_in_one_step() -> None:
    scheduler = make(num_blocks=8, block_size=4, max_model_len=32)
    tokens = prompt(0, 8)
    a = add(scheduler, 0, tokens, SamplingParams(max_tokens=2))
    b = add(scheduler, 1, tokens, SamplingParams(max_tokens=2))
    result = step(scheduler, constant_sampler(7))
    assert result is not None
    assert result.plan.seq_ids.tolist() == [0, 1] and result.plan.query_lens.tolist() == [8, 8]
    assert set(a.block_table).isdisjoint(b.block_table)
    pool = scheduler.pool
    assert pool.stats().num_cached_blocks == 4  # two copies of two blocks
    pool.check_integrity()
    run_to_completion(scheduler, constant_sampler(7))
    assert a.completion_token_ids == b.completion_token_ids == [7, 7]
    assert_all_free(scheduler)
    # Evict copies until one of each block is left: the prefix is still found.
    hashes = chain_hashes(tokens, 4)
    pool.allocate(pool.num_free_blocks - 2)
    assert len(pool.find_cached_prefix(hashes, tokens)) == 2
    pool.check_integrity()


# ----------------------------------------------------------------------------------- stats
def test_stats_count_queues_and_steps() -> None:
    scheduler = make(max_num_seqs=1)
    add(scheduler, 0, prompt(0, 3), SamplingParams(max_tokens=2))
    add(scheduler, 1, prompt(1, 3), SamplingParams(max_tokens=2))
    stats = scheduler.stats()
    assert (stats.num_waiting, stats.num_running) == (2, 0)
    step(scheduler, constant_sampler(7))
    stats = scheduler.stats()
    assert (stats.num_waiting, stats.num_running) == (1, 1)
    run_to_completion(scheduler, constant_sampler(7))
    stats = scheduler.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_preemptions) == (0, 0, 0)
    assert (stats.num_prefill_steps, stats.num_decode_steps) == (2, 2)


# ------------------------------------------------------------------- the decode hot path
# Not compared: the deltas and step numbers, and what only chunks carry for speculative
# decoding (a decode row built as a one-token chunk would count as a generation token).
_NOT_COMPARED = (
    "released_slots",
    "new_requests",
    "step_id",
    "recorded_step_id",
    "block_table_lens",
    "num_generation_tokens",
)


def plan_fields(plan: BatchPlan) -> dict[str, object]:
    return {
        field.name: getattr(plan, field.name)
        for field in dataclasses.fields(plan)
        if field.name not in _NOT_COMPARED
    }


@pytest.mark.parametrize(
    ("policy", "budget"), [("mixed", 1024), ("mixed", 7), ("prefill_first", 7)]
)
def test_decode_plans_equal_the_from_scratch_builder_across_blocks_and_finishes(
    policy: str, budget: int
) -> None:
    # Block size 4, staggered lengths and arrivals: rows open blocks and finish on different
    # steps, the widest row leaves; every plan with decode rows (decode or mixed) must equal
    # one built from the sequences: decode rows in running order, then the chunks.
    scheduler = make(
        num_blocks=64, block_size=4, max_model_len=40, max_num_batched_tokens=budget, policy=policy
    )
    seqs = [
        add(scheduler, i, prompt(i, 3 + 2 * i), SamplingParams(max_tokens=4 + 5 * (i % 3)))
        for i in range(3)
    ]
    sampler = hash_sampler()
    decode_steps = mixed_steps = 0
    while scheduler.has_unfinished():
        if decode_steps + mixed_steps in (2, 5):  # arrivals while others decode
            n = len(seqs)
            seqs.append(add(scheduler, n, prompt(n, 3 + 2 * n), SamplingParams(max_tokens=9)))
        plan = scheduler.schedule()
        assert plan is not None
        if plan.num_decode_rows:
            decode_steps += not plan.is_prefill
            mixed_steps += plan.is_mixed
            rows = [ScheduledChunk(seq, 1) for seq in scheduler.running if seq.decoding]
            assert plan.num_decode_rows == len(rows)
            for row in range(len(rows), plan.num_seqs):
                seq = scheduler.get(plan.seq_ids[row])
                assert seq is not None and not seq.decoding
                rows.append(ScheduledChunk(seq, plan.query_lens[row]))
            expected = build_batch_plan(rows, is_prefill=plan.is_prefill, block_size=4)
            expected = dataclasses.replace(expected, num_decode_rows=plan.num_decode_rows)
            assert plan_fields(plan) == plan_fields(expected)
        tokens = [sampler(scheduler.get(i).token_ids) for i in plan.sampled_seq_ids]  # type: ignore[union-attr]
        scheduler.postprocess(plan, tokens)
        scheduler.check_integrity()
    assert decode_steps + mixed_steps >= 10
    assert (mixed_steps > 0) == (policy == "mixed")
    assert scheduler.stats().num_mixed_steps == mixed_steps
    assert all(seq.is_finished for seq in seqs)
    assert_all_free(scheduler)


def test_stop_tokens_finish_only_the_rows_they_stop() -> None:
    # EOS 7 is sampled by both rows; only the one that does not ignore EOS finishes.
    scheduler = make(eos=frozenset({7}))
    a = add(scheduler, 0, prompt(0, 3), SamplingParams(max_tokens=10))
    b = add(scheduler, 1, prompt(1, 3), SamplingParams(max_tokens=10, ignore_eos=True))
    c = add(scheduler, 2, prompt(2, 3), SamplingParams(max_tokens=10, stop_token_ids=[5]))
    step(scheduler, constant_sampler(3))  # prefill
    result = step(scheduler, lambda tokens: 7 if tokens[0] != 300 else 5)
    assert result is not None and not result.plan.is_prefill
    assert [seq.seq_id for seq in result.updated] == [0, 1, 2]
    assert (a.finish_reason, b.finish_reason, c.finish_reason) == (
        FinishReason.STOP,
        None,
        FinishReason.STOP,
    )
    assert scheduler.running == [b]
    scheduler.check_integrity()


def test_abort_between_a_decode_schedule_and_its_postprocess() -> None:
    scheduler = make()
    a, b, c = (add(scheduler, i, prompt(i, 3)) for i in range(3))
    step(scheduler, constant_sampler(7))
    plan = scheduler.schedule()
    assert plan is not None and not plan.is_prefill
    scheduler.abort(1)
    updated = scheduler.postprocess(plan, [8, 9, 10])
    assert updated == [a, c]
    assert (a.completion_token_ids, b.completion_token_ids, c.completion_token_ids) == (
        [7, 8],
        [7],
        [7, 10],
    )
    scheduler.check_integrity()
    result = step(scheduler, constant_sampler(11))  # the rows are rebuilt without b
    assert result is not None and result.plan.seq_ids.tolist() == [0, 2]
    scheduler.check_integrity()


def test_postprocess_takes_only_the_latest_plan_once() -> None:
    scheduler = make()
    add(scheduler, 0, prompt(0, 3))
    first = scheduler.schedule()
    second = scheduler.schedule()  # the first was abandoned: its work is planned again
    assert first is not None and second is not None
    with pytest.raises(ValueError, match="latest schedule"):
        scheduler.postprocess(first, [7])
    scheduler.postprocess(second, [7])
    with pytest.raises(ValueError, match="latest schedule"):
        scheduler.postprocess(second, [7])


def test_an_abandoned_plan_is_planned_again() -> None:
    scheduler = make(block_size=4)
    add(scheduler, 0, prompt(0, 4))  # the first decode token opens a new block
    add(scheduler, 1, prompt(1, 6))
    step(scheduler, constant_sampler(7))
    first = scheduler.schedule()
    again = scheduler.schedule()
    assert first is not None and again is not None and not again.is_prefill
    assert plan_fields(first) == plan_fields(again)
    scheduler.postprocess(again, [8, 9])
    scheduler.check_integrity()


# -------------------------------------------------------------------------- sampling slots
def test_a_request_gets_a_slot_at_its_first_admission_and_gives_it_back_at_the_end() -> None:
    scheduler = make(max_num_seqs=2)
    a = add(scheduler, 0, prompt(0, 3), SamplingParams(max_tokens=1))
    b = add(scheduler, 1, prompt(1, 3), SamplingParams(max_tokens=3, temperature=0.5))
    c = add(scheduler, 2, prompt(2, 3), SamplingParams(max_tokens=2, seed=9))
    result = step(scheduler, constant_sampler(7))
    assert result is not None
    plan = result.plan
    assert [(r.seq_id, r.slot, r.params, r.num_prompt_tokens) for r in plan.new_requests] == [
        (0, 0, a.params, 3),
        (1, 1, b.params, 3),
    ]
    assert plan.sample_slots.tolist() == [0, 1] and plan.released_slots == ()
    assert a.is_finished and a.slot == -1 and b.slot == 1 and c.slot == -1
    result = step(scheduler, constant_sampler(7))  # c is admitted into the freed slot
    assert result is not None
    assert result.plan.released_slots == (0,)
    assert [(r.seq_id, r.slot) for r in result.plan.new_requests] == [(2, 0)]
    assert c.slot == 0
    scheduler.check_integrity()


def test_deltas_repeat_until_a_plan_is_postprocessed() -> None:
    scheduler = make()
    add(scheduler, 0, prompt(0, 3))
    first = scheduler.schedule()
    again = scheduler.schedule()  # `first` failed to run
    assert first is not None and again is not None
    assert [r.slot for r in again.new_requests] == [0]
    scheduler.postprocess(again, [7])
    plan = scheduler.schedule()
    assert plan is not None and plan.new_requests == () and plan.released_slots == ()


def test_a_preempted_request_keeps_its_slot() -> None:
    scheduler = make(num_blocks=4, block_size=4, max_model_len=16)
    a = add(scheduler, 0, prompt(0, 4))
    b = add(scheduler, 1, prompt(1, 4))
    sampler = constant_sampler(7)
    for _ in range(8):
        step(scheduler, sampler)
        scheduler.check_integrity()
    assert scheduler.stats().num_preemptions == 1
    assert (a.slot, b.slot) == (0, 1)


def test_check_integrity_finds_a_missing_calendar_entry() -> None:
    scheduler = make()
    add(scheduler, 0, prompt(0, 3))
    step(scheduler, constant_sampler(7))
    step(scheduler, constant_sampler(7))
    scheduler.check_integrity()
    scheduler._rows.calendar.clear()
    with pytest.raises(AssertionError, match="is not filed"):
        scheduler.check_integrity()


# --------------------------------------------------------------------------- mixed steps
def test_config_refuses_an_unknown_scheduling_policy() -> None:
    with pytest.raises(ConfigurationError, match="scheduling_policy='decode_first'"):
        SchedulerConfig(
            num_blocks=8, block_size=4, max_model_len=16, scheduling_policy="decode_first"
        )
    assert (
        SchedulerConfig(num_blocks=8, block_size=4, max_model_len=16).scheduling_policy == "mixed"
    )


def test_decode_rows_come_first_and_prefill_chunks_share_the_rest_of_the_budget() -> None:
    scheduler = make(max_num_batched_tokens=5, block_size=4)
    add(scheduler, 0, prompt(0, 3))
    add(scheduler, 1, prompt(1, 2))
    sampler = constant_sampler(7)
    step(scheduler, sampler)  # both prompts in one prefill step
    add(scheduler, 2, prompt(2, 8))
    layouts = []
    for _ in range(4):
        result = step(scheduler, sampler)
        assert result is not None
        plan = result.plan
        layouts.append((plan.seq_ids.tolist(), plan.query_lens.tolist(), plan.num_decode_rows))
    assert layouts == [
        ([0, 1, 2], [1, 1, 3], 2),  # 2 decode rows + 3 of the 8 prompt tokens
        ([0, 1, 2], [1, 1, 3], 2),
        ([0, 1, 2], [1, 1, 2], 2),  # the prompt's last 2 tokens: sampled
        ([0, 1, 2], [1, 1, 1], 3),  # 2 starts decoding: a decode step of 3 rows
    ]
    stats = scheduler.stats()
    assert (stats.num_prefill_steps, stats.num_mixed_steps, stats.num_decode_steps) == (1, 3, 1)
    scheduler.check_integrity()


def test_partly_prefilled_sequences_come_before_new_admissions() -> None:
    scheduler = make(max_num_batched_tokens=4, block_size=4)
    add(scheduler, 0, prompt(0, 1))
    sampler = constant_sampler(7)
    step(scheduler, sampler)  # 0 decodes from now on
    add(scheduler, 1, prompt(1, 6))
    add(scheduler, 2, prompt(2, 2))
    first = step(scheduler, sampler)
    second = step(scheduler, sampler)
    assert first is not None and second is not None
    assert (first.plan.seq_ids.tolist(), first.plan.query_lens.tolist()) == ([0, 1], [1, 3])
    # 1 continues (3 tokens) before 2 is admitted: nothing left for 2 this step.
    assert (second.plan.seq_ids.tolist(), second.plan.query_lens.tolist()) == ([0, 1], [1, 3])
    third = step(scheduler, sampler)
    assert third is not None
    assert (third.plan.seq_ids.tolist(), third.plan.query_lens.tolist()) == ([0, 1, 2], [1, 1, 2])


def count_stalls(policy: str) -> tuple[int, int]:
    """Steps in which a running decoding sequence got no token, and preemptions, while long
    prompts arrive in chunks among decoding sequences."""
    scheduler = make(
        num_blocks=128, block_size=4, max_num_batched_tokens=8, max_model_len=128, policy=policy
    )
    sampler = hash_sampler()
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for seq_id in range(3):
        add(scheduler, seq_id, prompt(seq_id, 2), params)
    stalls = 0
    for index in range(200):
        if index % 10 == 5 and index < 60:  # a long prompt arrives every 10 steps
            add(scheduler, 3 + index, prompt(3 + index, 40), params)
        decoding = {seq.seq_id for seq in scheduler.running if seq.decoding}
        result = step(scheduler, sampler)
        if result is None:
            break
        served = set(result.plan.seq_ids[: result.plan.num_decode_rows])
        still_running = {seq.seq_id for seq in scheduler.running} | {
            seq.seq_id for seq in result.updated
        }
        stalls += bool((decoding & still_running) - served)
    assert not scheduler.has_unfinished()
    return stalls, scheduler.stats().num_preemptions


def test_decoding_sequences_never_stall_behind_a_prefill_under_the_mixed_policy() -> None:
    assert count_stalls("mixed") == (0, 0)
    stalls, preemptions = count_stalls("prefill_first")
    assert preemptions == 0 and stalls >= 6 * 5  # every chunk of every long prompt


def test_a_step_that_preempts_admits_nothing() -> None:
    # Pool of 4 blocks of 2: a and b decode in two blocks each; a's next token needs a third
    # block: b is preempted. c waits: nothing is admitted in the step that preempted.
    scheduler = make(num_blocks=4, block_size=2, max_model_len=8)
    a = add(scheduler, 0, [1, 2, 3])
    b = add(scheduler, 1, [4, 5, 6])
    sampler = constant_sampler(9)
    step(scheduler, sampler)
    c = add(scheduler, 2, [7])
    step(scheduler, sampler)  # decode position 3; c does not fit
    result = step(scheduler, sampler)
    assert result is not None and result.plan.seq_ids.tolist() == [0]
    assert b.status is SequenceStatus.WAITING and c.status is SequenceStatus.WAITING
    assert list(scheduler.waiting) == [b, c]
    assert a.num_preemptions == 0 and b.num_preemptions == 1
    scheduler.check_integrity()


def test_abort_between_a_mixed_schedule_and_its_postprocess() -> None:
    scheduler = make(max_num_batched_tokens=6)
    a, b = (add(scheduler, i, prompt(i, 3)) for i in range(2))
    step(scheduler, constant_sampler(7))
    c = add(scheduler, 2, prompt(2, 3))
    d = add(scheduler, 3, prompt(3, 9))
    plan = scheduler.schedule()
    assert plan is not None and plan.is_mixed
    assert (plan.seq_ids.tolist(), plan.query_lens.tolist()) == ([0, 1, 2, 3], [1, 1, 3, 1])
    scheduler.abort(1)
    updated = scheduler.postprocess(plan, [8, 9, 10])  # rows 0, 1 and 2 are sampled
    assert updated == [a, c]
    assert (a.completion_token_ids, c.completion_token_ids) == ([7, 8], [10])
    assert d.num_computed_tokens == 1 and b.is_finished
    scheduler.check_integrity()
    result = step(scheduler, constant_sampler(11))  # the rows are rebuilt without b
    assert result is not None and result.plan.seq_ids.tolist() == [0, 2, 3]
    assert result.plan.num_decode_rows == 2
    scheduler.check_integrity()


def test_a_decoder_finishes_in_the_step_that_completes_a_prompt() -> None:
    scheduler = make(max_num_batched_tokens=4, block_size=2)
    a = add(scheduler, 0, prompt(0, 2), SamplingParams(max_tokens=2, ignore_eos=True))
    sampler = hash_sampler()
    step(scheduler, sampler)
    b = add(scheduler, 1, prompt(1, 3), SamplingParams(max_tokens=3, ignore_eos=True))
    result = step(scheduler, sampler)  # a's last token, b's whole prompt
    assert result is not None and result.plan.is_mixed and result.updated == [a, b]
    assert a.is_finished and b.decoding
    scheduler.check_integrity()
    result = step(scheduler, sampler)  # b's first decode, alone
    assert result is not None and result.plan.seq_ids.tolist() == [1]
    assert not result.plan.is_prefill
    scheduler.check_integrity()
    run_to_completion(scheduler, sampler)
    assert b.num_completion_tokens == 3
    assert_all_free(scheduler)
