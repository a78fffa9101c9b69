"""Several completions of one prompt (``SamplingParams.n > 1``): who forks from whom, when.

A request's other completions (its *forks*) are filed under its first sequence (the
parent): *pending* until the step computing the parent's last prompt token is planned,
then *forking* until that plan is recorded, then sequences of their own. A fork takes the
prompt's full blocks shared and a device copy of its partial last block
(``BatchPlan.block_copies``); the copy's source stays pinned until a plan carrying the
copy is recorded (with several KV groups, a copy per group: :meth:`BlockAllocator.fork_blocks`).
:class:`ForkTable` keeps that state and answers the loop; it never
touches the queues (the loop moves a started fork into them).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from pagedinfer.domain.block_pool import BlockPool
from pagedinfer.domain.kv_groups import blocks_for_one_sequence
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.scheduler.allocator import BlockAllocator
from pagedinfer.domain.scheduler.config import SchedulerConfig
from pagedinfer.domain.scheduler.slots import SlotTable
from pagedinfer.domain.sequence import Sequence, SequenceStatus
from pagedinfer.errors import InvalidRequestError

__all__ = ["ForkTable", "check_new_forks"]


class ForkTable:
    """The forks of one scheduler's requests, and their pending block copies."""

    __slots__ = (
        "allocator",
        "block_copies",
        "copies_after_fork",
        "forking",
        "parent",
        "pending",
        "pool",
    )

    def __init__(self, pool: BlockPool, allocator: BlockAllocator | None = None) -> None:
        self.pool = pool
        self.allocator = allocator if allocator is not None else BlockAllocator(pool)
        self.pending: dict[int, list[Sequence]] = {}
        self.forking: dict[int, list[Sequence]] = {}
        self.parent: dict[int, int] = {}  # pending or forking child id -> parent id
        # Copies (source, destination) by the child receiving them (one per KV group):
        # made when the fork is planned, sent in every plan once the forking step ran until
        # one is recorded.
        self.copies_after_fork: dict[int, tuple[tuple[int, int], ...]] = {}
        self.block_copies: dict[int, tuple[tuple[int, int], ...]] = {}

    def add(self, parent: Sequence, children: list[Sequence]) -> None:
        self.pending[parent.seq_id] = children
        for child in children:
            self.parent[child.seq_id] = parent.seq_id

    def unstarted(self, parent_id: int | None = None) -> list[Sequence]:
        """Pending and forking children of ``parent_id``, or of every parent."""
        groups = (self.pending, self.forking)
        if parent_id is not None:
            return [child for forks in groups for child in forks.get(parent_id, ())]
        return [child for forks in groups for children in forks.values() for child in children]

    def num_committed(self, seqs: dict[int, Sequence], candidate_id: int) -> int:
        """Forks that count towards ``max_running`` already (of admitted parents, forking)
        or would with the admission of ``candidate_id``."""
        if not self.pending and not self.forking:
            return 0
        count = sum(
            len(children)
            for parent_id, children in self.pending.items()
            if seqs[parent_id].status is SequenceStatus.RUNNING
        )
        count += sum(len(children) for children in self.forking.values())
        return count + len(self.pending.get(candidate_id, ()))

    def extra_blocks(self, seq: Sequence) -> int:
        """Blocks the pending forks of ``seq`` take when they start: a copy of a partial
        last block each (a prompt that ends on a block boundary shares all of its blocks)."""
        forks = self.pending.get(seq.seq_id)
        if not forks or seq.num_tokens % self.pool.block_size == 0:
            return 0
        return len(forks) * self.allocator.num_groups

    def fork(self, seq: Sequence, slots: SlotTable) -> tuple[Sequence, ...]:
        """Start ``seq``'s pending forks: the chunk being planned computes its last prompt
        token, and each fork samples from that row. Blocks and slots are given now
        (:meth:`extra_blocks` must be free); the forks run once the step is recorded."""
        children = self.pending.pop(seq.seq_id)
        for child in children:
            copies = self.allocator.fork_blocks(seq, child)
            if copies:
                self.copies_after_fork[child.seq_id] = copies
            child.num_computed_tokens = seq.num_tokens
            child.num_cached_tokens = seq.num_cached_tokens
            child.status = SequenceStatus.RUNNING
            slots.assign(child)
        self.forking[seq.seq_id] = children
        return tuple(children)

    def started(self, child: Sequence) -> None:
        """The forking step of ``child`` was recorded: it is a sequence of its own, and its
        block copy goes out with every plan until one carrying it is recorded."""
        del self.parent[child.seq_id]
        copy = self.copies_after_fork.pop(child.seq_id, None)
        if copy is not None:
            self.block_copies[child.seq_id] = copy

    def undo(self) -> list[Sequence]:
        """The plan that forked was never recorded: its forks go back to pending. Returns
        them, for the loop to take their blocks and slots back."""
        undone = []
        for parent_id, children in self.forking.items():
            undone.extend(children)
            self.pending[parent_id] = children
        self.forking = {}
        return undone

    def remove(self, child: Sequence) -> int | None:
        """Forget an unstarted ``child`` (it finished). Returns its parent's id if that
        was the parent's last pending fork, else ``None``."""
        parent_id = self.parent.pop(child.seq_id)
        for forks in (self.pending, self.forking):
            children = forks.get(parent_id)
            if children is not None and child in children:
                children.remove(child)
                if not children:
                    del forks[parent_id]
                    return parent_id
        return None

    def orphans(self, parent_id: int) -> list[Sequence]:
        """Forget and return the unstarted forks of ``parent_id`` (it ended before forking)."""
        return [*self.pending.pop(parent_id, ()), *self.forking.pop(parent_id, ())]

    def copies_to_send(self, ahead: BatchPlan | None) -> tuple[tuple[int, int], ...]:
        """The copies for the next plan, less those ``ahead`` (the plan in flight) carries."""
        if not self.block_copies:
            return ()
        copies = tuple(copy for group in self.block_copies.values() for copy in group)
        if ahead is not None and ahead.block_copies:
            copies = tuple(copy for copy in copies if copy not in ahead.block_copies)
        return copies

    def confirm(self, plan: BatchPlan) -> None:
        """``plan`` ran: its copies are done, their sources unpinned."""
        if not plan.block_copies:
            return
        done = set(plan.block_copies)
        for child_id, copies in list(self.block_copies.items()):
            if copies[0] in done:  # a child's copies always go out together
                del self.block_copies[child_id]
                self.pool.free([source for source, _ in copies])  # unpin the sources

    def drop_copy(self, child_id: int) -> None:
        """Forget the copy into ``child_id``'s blocks (they are being released): it must
        not run once they are free."""
        if not self.copies_after_fork and not self.block_copies:
            return
        copies = self.copies_after_fork.pop(child_id, None) or self.block_copies.pop(child_id, None)
        if copies is not None:
            self.pool.free([source for source, _ in copies])  # unpin the sources

    def check(self, seqs: dict[int, Sequence], *, plan_in_flight: bool) -> None:
        """Raise ``AssertionError`` if the table disagrees with the sequences or the pool."""
        children = self.unstarted()
        if sorted(c.seq_id for c in children) != sorted(self.parent):
            raise AssertionError("pending and forking completions disagree with their parents")
        for parent_id, pending in self.pending.items():
            parent = seqs.get(parent_id)
            if parent is None or parent.decoding or not pending:
                raise AssertionError(f"pending forks of {parent_id} but no prefilling parent")
            for child in pending:
                if (
                    child.block_table
                    or child.slot >= 0
                    or child.status is not SequenceStatus.WAITING
                ):
                    raise AssertionError(f"pending fork {child!r} holds resources")
        if self.forking and not plan_in_flight:
            raise AssertionError("forks in flight without a plan in flight")
        copies = [
            (child_id, copy)
            for table in (self.copies_after_fork, self.block_copies)
            for child_id, group in table.items()
            for copy in group
        ]
        for child_id, (source, target) in copies:
            holder = seqs.get(child_id)
            if holder is None or not any(
                target in table for table in (holder.block_table, *holder.group_block_tables)
            ):
                raise AssertionError(f"a block copy into {target} that {child_id} does not hold")
            if self.pool.block(source).ref_count < 1:
                raise AssertionError(f"the source {source} of a pending copy is free")


def check_new_forks(
    seq: Sequence,
    forks: SequenceABC[Sequence],
    known: dict[int, Sequence],
    config: SchedulerConfig,
) -> None:
    """Raise :class:`InvalidRequestError` unless ``forks`` can be the other completions of a
    new request ``seq`` (``known``: the unfinished sequences by id)."""
    n = 1 + len(forks)
    if n > config.max_running:
        raise InvalidRequestError(
            f"n={n} completions cannot run at once: at most "
            f"min(max_num_seqs, max_num_batched_tokens)={config.max_running} "
            "sequences run together. Lower n or raise max_num_seqs."
        )
    size = config.block_size
    blocks = blocks_for_one_sequence(  # every KV group's table (a sliding one: its window's)
        config.kv_groups,
        size,
        seq.num_tokens,
        config.max_num_batched_tokens,
        copies=len(forks) if seq.num_tokens % size else 0,
    )
    if blocks > config.num_blocks:
        raise InvalidRequestError(
            f"the prompt and copies of its last block for n={n} completions need "
            f"{blocks} KV blocks; the pool has {config.num_blocks}. Lower n, shorten "
            "the prompt or give the KV cache more blocks."
        )
    ids = {seq.seq_id}
    for child in forks:
        if child.seq_id in ids or child.seq_id in known:
            raise InvalidRequestError(f"request id {child.seq_id} is used twice.")
        ids.add(child.seq_id)
        if child.status is not SequenceStatus.WAITING or child.block_table or child.slot >= 0:
            raise InvalidRequestError(f"{child!r} is not a fresh request.")
        if child.token_ids != seq.token_ids:
            raise InvalidRequestError("the completions of a request must share its prompt.")
