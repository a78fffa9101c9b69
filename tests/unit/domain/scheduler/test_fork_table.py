"""n > 1: a request's completions fork from its prompt, sharing its KV blocks (no model)."""

from __future__ import annotations

import pytest

from pagedinfer.domain import (
    BatchPlan,
    BlockPool,
    FinishReason,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
    build_batch_plan,
    make_forks,
)
from pagedinfer.domain.scheduler.fork_table import ForkTable
from pagedinfer.domain.scheduler.slots import SlotTable
from pagedinfer.errors import InvalidRequestError

LONG = SamplingParams(max_tokens=20, ignore_eos=True)


def make(
    *, num_blocks: int = 32, budget: int = 64, max_num_seqs: int = 8, caching: bool = True
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=4,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=64,
            enable_prefix_caching=caching,
        )
    )


def request(
    first_id: int, prompt: list[int], n: int, params: SamplingParams = LONG
) -> list[Sequence]:
    return [Sequence(first_id + i, prompt, params) for i in range(n)]


def add(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    scheduler.add(seqs[0], forks=seqs[1:])


def run_step(scheduler: Scheduler, tokens: dict[int, int] | None = None) -> BatchPlan:
    """One step; every sample gets a token derived from its sequence id (distinct per fork)."""
    plan = scheduler.schedule()
    assert plan is not None
    sampled = [
        (tokens or {}).get(seq_id, 100 + seq_id + plan.positions[index])
        for seq_id, index in zip(plan.sampled_seq_ids, plan.sample_indices, strict=True)
    ]
    scheduler.postprocess(plan, sampled)
    scheduler.check_integrity()
    scheduler.pool.check_integrity()
    return plan


def run_all(scheduler: Scheduler) -> list[BatchPlan]:
    plans = []
    for _ in range(500):
        if not scheduler.has_unfinished():
            return plans
        plans.append(run_step(scheduler))
    raise AssertionError("not finished")


def test_the_prompt_is_computed_once_and_sampled_once_per_completion() -> None:
    scheduler = make()
    seqs = request(0, list(range(10)), n=3)  # 10 tokens: two full blocks and a partial one
    add(scheduler, seqs)
    plan = run_step(scheduler, {0: 7, 1: 8, 2: 9})
    assert plan.is_prefill and plan.seq_ids.tolist() == [0]
    assert plan.num_tokens == 10  # the prompt, once
    assert plan.sample_indices.tolist() == [9, 9, 9]  # its last row, once per completion
    assert plan.sample_slots.tolist() == [s.slot for s in seqs]
    assert len(set(plan.sample_slots)) == 3
    assert plan.forks == ((1, 1), (2, 2)) and plan.sampled_seq_ids == [0, 1, 2]
    assert plan.block_copies == ()  # the last block is written by this very step
    assert [s.completion_token_ids for s in seqs] == [[7], [8], [9]]
    parent, first, second = seqs
    shared = parent.block_table[:2]
    assert first.block_table[:2] == second.block_table[:2] == shared
    assert len({parent.block_table[2], first.block_table[2], second.block_table[2]}) == 3
    pool = scheduler.pool
    assert [pool.block(b).ref_count for b in shared] == [3, 3]
    assert pool.block(parent.block_table[2]).ref_count == 3  # its own + two pinned copies
    # The next step (every completion decodes) copies the partial block first.
    plan = run_step(scheduler)
    assert not plan.is_prefill and plan.seq_ids.tolist() == [0, 1, 2]
    assert set(plan.block_copies) == {
        (parent.block_table[2], first.block_table[2]),
        (parent.block_table[2], second.block_table[2]),
    }
    assert pool.block(parent.block_table[2]).ref_count == 1  # copies recorded: unpinned
    plan = run_step(scheduler)
    assert plan.block_copies == ()
    plans = [plan, *run_all(scheduler)]
    assert all(not p.is_prefill for p in plans)  # no completion recomputes the prompt
    assert all(s.num_completion_tokens == 20 for s in seqs)
    assert pool.num_free_blocks == pool.num_blocks


def test_a_prompt_ending_on_a_block_boundary_shares_every_block() -> None:
    scheduler = make()
    seqs = request(0, list(range(8)), n=2)
    add(scheduler, seqs)
    run_step(scheduler)
    assert seqs[1].block_table == seqs[0].block_table
    plan = run_step(scheduler)
    assert plan.block_copies == ()
    assert seqs[0].block_table[2] != seqs[1].block_table[2]  # each opened its own next block
    run_all(scheduler)


def test_chunked_prefill_forks_in_the_step_with_the_last_prompt_token() -> None:
    # A budget of one token: the prompt is prefilled one token per step, and its last token
    # is still a prefill step (not a decode step), so the forks are sampled with it.
    scheduler = make(budget=1, max_num_seqs=1)
    with pytest.raises(InvalidRequestError, match="n=2"):
        add(scheduler, request(0, [1, 2, 3], n=2))
    scheduler = make(budget=2, max_num_seqs=4)
    seqs = request(0, [1, 2, 3, 4, 5], n=2)
    add(scheduler, seqs)
    plans = [run_step(scheduler) for _ in range(3)]
    assert [p.num_tokens for p in plans] == [2, 2, 1]
    assert all(p.is_prefill for p in plans)
    assert plans[-1].sampled_seq_ids == [0, 1]
    run_all(scheduler)


def test_forks_count_towards_max_num_seqs_from_admission() -> None:
    scheduler = make(max_num_seqs=3)
    add(scheduler, request(0, [1, 2, 3], n=2))
    add(scheduler, request(10, [4, 5, 6], n=2))
    plan = run_step(scheduler)
    assert plan.seq_ids.tolist() == [0]  # 2 + 2 > 3: the second request waits
    assert len(scheduler.running) == 2
    run_all(scheduler)


def test_aborting_the_first_completion_before_the_fork_ends_the_others() -> None:
    scheduler = make(budget=4)
    seqs = request(0, list(range(10)), n=3)
    add(scheduler, seqs)
    run_step(scheduler)  # a first chunk: not forked yet
    assert scheduler.abort(0)
    assert all(s.finish_reason is FinishReason.ABORT for s in seqs)
    assert not scheduler.has_unfinished()
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks
    assert not scheduler.abort(1)  # already finished


def test_aborting_one_fork_before_it_starts() -> None:
    scheduler = make(budget=4)
    seqs = request(0, list(range(10)), n=3)
    add(scheduler, seqs)
    assert scheduler.abort(1)
    plans = run_all(scheduler)
    assert plans[2].sampled_seq_ids == [0, 2]
    assert seqs[1].is_finished and seqs[1].completion_token_ids == []
    assert seqs[2].num_completion_tokens == 20


def test_a_fork_abandoned_with_its_plan_is_planned_again() -> None:
    scheduler = make()
    seqs = request(0, list(range(10)), n=3)
    add(scheduler, seqs)
    first = scheduler.schedule()  # never postprocessed: the step "failed"
    assert first is not None and first.sampled_seq_ids == [0, 1, 2]
    again = scheduler.schedule()
    assert again is not None and again.sampled_seq_ids == [0, 1, 2]
    # The undone forks' slots are released, then installed again (releases apply first).
    installed = {r.slot: r.seq_id for r in again.new_requests}
    assert {installed[s.slot] for s in seqs} == {0, 1, 2}
    assert {seqs[1].slot, seqs[2].slot} <= set(again.released_slots)
    scheduler.postprocess(again, [1, 2, 3])
    scheduler.check_integrity()
    run_all(scheduler)
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks


def test_a_fork_that_finishes_at_its_first_token_drops_its_copy() -> None:
    scheduler = make()
    parent = Sequence(0, list(range(10)), SamplingParams(max_tokens=5, ignore_eos=True))
    child = Sequence(1, list(range(10)), SamplingParams(max_tokens=1))
    scheduler.add(parent, forks=[child])
    run_step(scheduler)
    assert child.finish_reason is FinishReason.LENGTH and child.block_table == []
    plan = run_step(scheduler)
    assert plan.block_copies == ()
    run_all(scheduler)
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks


def test_preempted_forks_recompute_on_their_own() -> None:
    # A pool that cannot hold every completion's growth: forks get preempted and recomputed
    # (from the prefix cache where it still holds their blocks), and all finish.
    scheduler = make(num_blocks=16)
    seqs = request(0, list(range(10)), n=4, params=SamplingParams(max_tokens=40, ignore_eos=True))
    add(scheduler, seqs)
    run_all(scheduler)
    assert scheduler.stats().num_preemptions == 5  # deterministic: the same run every time
    assert all(s.num_completion_tokens == 40 for s in seqs)
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks


def test_requests_that_can_never_fork_are_refused() -> None:
    scheduler = make(max_num_seqs=8)
    with pytest.raises(InvalidRequestError, match="n=9"):
        add(scheduler, request(0, [1, 2, 3], n=9))
    scheduler = make(num_blocks=16)  # 64 tokens: one max_model_len sequence
    with pytest.raises(InvalidRequestError, match="need 17 KV blocks"):
        add(scheduler, request(0, list(range(61)), n=2))  # 16 blocks + a copy of the last
    add(scheduler, request(0, list(range(60)), n=2))  # on a block boundary: no copy
    assert scheduler.num_unfinished == 2


def test_bad_forks_are_refused() -> None:
    scheduler = make()
    with pytest.raises(InvalidRequestError, match="share its prompt"):
        scheduler.add(Sequence(0, [1, 2]), forks=[Sequence(1, [1, 3])])
    with pytest.raises(InvalidRequestError, match="used twice"):
        scheduler.add(Sequence(0, [1, 2]), forks=[Sequence(0, [1, 2])])
    used = Sequence(5, [1, 2])
    used.status = SequenceStatus.RUNNING
    with pytest.raises(InvalidRequestError, match="not a fresh request"):
        scheduler.add(Sequence(0, [1, 2]), forks=[used])
    assert not scheduler.has_unfinished()


def test_a_parent_kept_prefilling_to_fork_decodes_once_its_forks_are_gone() -> None:
    # Budget 2, prompt of 3: the first chunk leaves one prompt token, which a request with
    # forks keeps for a prefill step; abort the only fork and it decodes like any sequence.
    scheduler = make(budget=2, max_num_seqs=2)
    seqs = request(0, [1, 2, 3], n=2)
    add(scheduler, seqs)
    run_step(scheduler)
    assert not seqs[0].decoding and seqs[0].num_uncomputed_tokens == 1
    assert scheduler.abort(1)
    scheduler.check_integrity()
    assert seqs[0].decoding
    plan = run_step(scheduler)
    assert not plan.is_prefill and plan.sampled_seq_ids == [0]
    run_all(scheduler)


def test_a_preempted_fork_drops_its_pending_copy() -> None:
    # Found by the state machine: a fork preempted while its copy of the prompt's last block
    # was still pending (the plan carrying it was abandoned) left the copy targeting a freed
    # block, which another sequence could get.
    scheduler = make(num_blocks=16)
    seqs = request(0, list(range(10)), n=3)
    add(scheduler, seqs)
    run_step(scheduler)  # the fork: copies pending for the next plan
    pending = scheduler.schedule()  # carries them, and is abandoned
    assert pending is not None and len(pending.block_copies) == 2
    child = seqs[2]
    target = child.block_table[-1]
    scheduler._preempt(child)
    assert all(dst != target for _, dst in scheduler.pending_block_copies)
    scheduler.check_integrity()
    scheduler.pool.check_integrity()
    run_all(scheduler)
    assert all(s.num_completion_tokens == 20 for s in seqs)
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks


# ForkTable directly: pending, forking, started, and the copies' pins.


def fork_setup(prompt_len: int = 6) -> tuple[ForkTable, SlotTable, Sequence, list[Sequence]]:
    pool = BlockPool(8, 4)
    table = ForkTable(pool)
    parent = Sequence(0, list(range(prompt_len)), SamplingParams(n=3))
    children = make_forks(parent)
    table.add(parent, children)
    parent.block_table = [block.block_id for block in pool.allocate(2)]
    return table, SlotTable(), parent, children


def test_fork_table_from_pending_to_started() -> None:
    table, slots, parent, children = fork_setup()
    assert table.unstarted(0) == children
    assert table.extra_blocks(parent) == 2  # a partial last block: one copy per fork
    forked = table.fork(parent, slots)
    assert forked == tuple(children) and 0 in table.forking and 0 not in table.pending
    first_block, partial = parent.block_table
    for child in children:
        assert child.block_table[0] == first_block  # shared
        assert child.block_table[1] != partial  # its own copy
        assert child.slot >= 0 and child.num_computed_tokens == 6
    assert table.pool.block(partial).ref_count == 3  # pinned by both copies
    assert table.pool.block(first_block).ref_count == 3
    table.forking.pop(0)
    for child in children:
        table.started(child)
    assert table.parent == {} and len(table.block_copies) == 2
    copies = tuple(copy for group in table.block_copies.values() for copy in group)
    assert table.copies_to_send(None) == copies and len(copies) == 2


def test_a_confirmed_copy_unpins_its_source() -> None:
    table, slots, parent, children = fork_setup()
    table.fork(parent, slots)
    table.forking.pop(0)
    for child in children:
        table.started(child)
    partial = parent.block_table[1]
    copies = table.copies_to_send(None)
    plan = build_batch_plan([], is_prefill=True, block_size=4, block_copies=copies[:1])
    table.confirm(plan)
    assert table.pool.block(partial).ref_count == 2 and len(table.block_copies) == 1
    table.drop_copy(children[1].seq_id)
    assert table.pool.block(partial).ref_count == 1 and not table.block_copies


def test_undo_returns_the_forks_to_pending() -> None:
    table, slots, parent, children = fork_setup()
    table.fork(parent, slots)
    assert table.undo() == children
    assert table.pending == {0: children} and table.forking == {}


def test_removing_the_last_fork_names_the_parent() -> None:
    table, _, parent, children = fork_setup()
    first, second = children  # (the table holds this very list)
    assert table.remove(first) is None
    assert table.remove(second) == parent.seq_id
    assert table.pending == {} and table.parent == {}


def test_a_prompt_on_a_block_boundary_needs_no_copy() -> None:
    table, _, parent, _ = fork_setup(prompt_len=8)
    assert table.extra_blocks(parent) == 0
    assert table.num_committed({0: parent}, candidate_id=0) == 2  # its own, at admission
