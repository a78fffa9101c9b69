"""PrefillPlanner by example: partly prefilled sequences first, then admissions in arrival
order cut to the budget; drafts, lookahead and forks ride on the chunk that reaches a
sequence's end; planned ahead, what waits for the plan in flight's token waits. The planner
decides; the queues stay the loop's."""

from __future__ import annotations

from collections import deque

from pagedinfer.domain import BlockPool, SchedulerConfig, Sequence, SequenceStatus
from pagedinfer.domain.plan import PENDING_TOKEN
from pagedinfer.domain.scheduler.allocator import BlockAllocator
from pagedinfer.domain.scheduler.fork_table import ForkTable
from pagedinfer.domain.scheduler.prefill import PrefillDecision, PrefillPlanner
from pagedinfer.domain.scheduler.slots import SlotTable

BLOCK = 4


def make_planner(
    num_blocks: int = 16, **config: int
) -> tuple[PrefillPlanner, BlockAllocator, ForkTable]:
    pool = BlockPool(num_blocks, BLOCK, enable_prefix_caching=False)
    allocator = BlockAllocator(pool)
    forks = ForkTable(pool)
    settings = SchedulerConfig(num_blocks, BLOCK, max_model_len=num_blocks * BLOCK, **config)
    return PrefillPlanner(settings, allocator, forks, SlotTable()), allocator, forks


def plan(
    planner: PrefillPlanner,
    budget: int,
    prefilling: list[Sequence],
    waiting: list[Sequence],
    *,
    admit: bool = True,
    awaiting: frozenset[int] = frozenset(),
    ahead: bool = False,
) -> PrefillDecision:
    known = {seq.seq_id: seq for seq in [*prefilling, *waiting]}
    return planner.plan(
        budget,
        prefilling,
        deque(waiting),
        admit=admit,
        num_running=len(prefilling),
        known=known,
        awaiting=awaiting,
        ahead=ahead,
    )


def chunks_of(decision: PrefillDecision) -> list[tuple[int, int]]:
    return [(chunk.seq.seq_id, chunk.num_tokens) for chunk in decision.chunks]


def partly_prefilled(allocator: BlockAllocator, seq_id: int, prompt: int, done: int) -> Sequence:
    seq = Sequence(seq_id, list(range(1, prompt + 1)))
    assert allocator.allocate_slots(seq, done) is not None
    seq.num_computed_tokens = done
    seq.status = SequenceStatus.RUNNING
    seq.slot = seq_id
    return seq


def test_partial_prefills_first_then_admissions_in_order_cut_to_the_budget() -> None:
    planner, allocator, _ = make_planner()
    old = partly_prefilled(allocator, 0, prompt=10, done=4)
    new = [Sequence(i, list(range(1, 8))) for i in (1, 2, 3)]
    decision = plan(planner, 14, [old], new)
    assert chunks_of(decision) == [(0, 6), (1, 7), (2, 1)]  # the budget cuts request 2
    assert decision.admitted == new[:2]  # the head of the queue, for the loop to move
    for seq in decision.admitted:
        assert seq.status is SequenceStatus.RUNNING and seq.slot >= 0
    assert new[2].status is SequenceStatus.WAITING and new[2].block_table == []
    assert len(old.block_table) == 3  # its chunk's blocks: positions 0..9


def test_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    planner, allocator, _ = make_planner(num_blocks=3)
    big = Sequence(0, list(range(1, 14)))  # 13 tokens: 4 blocks
    small = Sequence(1, [1, 2])
    decision = plan(planner, 100, [], [big, small])
    assert decision.chunks == [] and decision.admitted == []  # first come, first served
    assert big.block_table == [] and big.status is SequenceStatus.WAITING
    assert allocator.num_free_blocks == 3
    decision = plan(planner, 8, [], [big, small])  # a chunk of 8 tokens fits in 2 blocks
    assert chunks_of(decision) == [(0, 8)] and decision.admitted == [big]
    decision = plan(planner, 100, [], [Sequence(2, list(range(1, 9))), small])
    assert chunks_of(decision) == []  # one block left: 8 tokens do not fit, nor after them
    assert small.status is SequenceStatus.WAITING


def test_no_admission_past_max_running_or_when_told_not_to() -> None:
    planner, allocator, _ = make_planner(max_num_seqs=1)
    old = partly_prefilled(allocator, 0, prompt=6, done=2)
    waiting = [Sequence(1, [1, 2])]
    assert chunks_of(plan(planner, 100, [old], waiting)) == [(0, 4)]  # one running already
    planner, allocator, _ = make_planner()
    old = partly_prefilled(allocator, 0, prompt=6, done=2)
    assert chunks_of(plan(planner, 100, [old], waiting, admit=False)) == [(0, 4)]


def test_a_chunk_reaching_the_end_computes_the_drafts_and_gets_lookahead_blocks() -> None:
    planner, allocator, _ = make_planner(num_speculative_tokens=2, num_lookahead_tokens=4)
    seq = partly_prefilled(allocator, 0, prompt=5, done=4)
    seq.spec_token_ids = [7, 8]
    decision = plan(planner, 100, [seq], [])
    assert chunks_of(decision) == [(0, 3)]  # its last token and two drafts
    # Positions 0..6 for the chunk, then 4 more as far as free blocks allow: 0..10.
    assert len(seq.block_table) == 3


def test_the_chunk_that_forks_needs_room_for_the_copies() -> None:
    planner, allocator, forks = make_planner(num_blocks=4)
    parent = partly_prefilled(allocator, 0, prompt=6, done=4)  # 2 blocks; ends mid-block
    children = [Sequence(i, list(parent.token_ids)) for i in (1, 2)]
    forks.add(parent, children)
    # Two free blocks: the two copies fit, but not with the parent's growth (none needed).
    decision = plan(planner, 100, [parent], [])
    assert chunks_of(decision) == [(0, 2)]
    assert decision.chunks[0].forks == tuple(children)
    assert all(child.status is SequenceStatus.RUNNING for child in children)

    planner, allocator, forks = make_planner(num_blocks=4)
    parent = partly_prefilled(allocator, 0, prompt=9, done=4)  # needs a third block
    children = [Sequence(i, list(parent.token_ids)) for i in (1, 2)]
    forks.add(parent, children)
    decision = plan(planner, 100, [parent], [])
    assert chunks_of(decision) == [(0, 4)]  # one token short: the last one must fork
    assert decision.chunks[0].forks == ()


def test_planned_ahead_what_waits_for_the_plan_in_flight_waits() -> None:
    planner, allocator, _ = make_planner()
    sampling = partly_prefilled(allocator, 0, prompt=6, done=4)  # its chunk in flight samples
    other = partly_prefilled(allocator, 1, prompt=6, done=2)
    preempted = Sequence(2, [1, 2, 3])
    preempted.token_ids.append(PENDING_TOKEN)  # its token is in the plan in flight
    fresh = Sequence(3, [4, 5])
    awaiting = frozenset({0})
    decision = plan(
        planner, 100, [sampling, other], [preempted, fresh], awaiting=awaiting, ahead=True
    )
    assert chunks_of(decision) == [(1, 4)]  # the queue waits behind the preempted request
    assert decision.admitted == []
    assert preempted.status is SequenceStatus.WAITING
    assert chunks_of(plan(planner, 100, [], [fresh], ahead=True)) == [(3, 2)]
