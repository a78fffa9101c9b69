"""The decode rows: one token per step for every decoding sequence, and their calendar.

The decoding sequences live in a :class:`~pagedinfer.domain.decode_batch.DecodeBatch` whose
arrays are moved on in bulk (:class:`DecodeRows`); a sequence is looked at on its own only
when something happens to it. Every decoding sequence advances exactly one token in every
step that has decode rows (a *decode-row step*: a decode or a mixed step), so the step at
which its last block fills up and the step at which it reaches its length limit are known
when it starts decoding. The rows file it under those steps (:meth:`DecodeCalendar.file_rows`)
and, after each decode-row step, look only at the sequences filed under it. Sampled stop
tokens are found with one set intersection per step.

:class:`DecodeRows` answers the loop with decisions: the rows that need a block (the loop
gives it, or preempts), the rows that stop on their token (the loop finishes them). It never
calls back into the loop, and owns no queue.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

from pagedinfer.domain.decode_batch import DecodeBatch
from pagedinfer.domain.plan import PENDING_TOKEN, BatchPlan
from pagedinfer.domain.scheduler.ahead import carried_rows
from pagedinfer.domain.scheduler.allocator import BlockAllocator
from pagedinfer.domain.scheduler.stop_rules import StopRules
from pagedinfer.domain.sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["DecodeCalendar", "DecodeRows", "sort_in_running_order"]


class DecodeCalendar:
    """Sequences filed by decode-row step (duplicates and stale entries are harmless: what
    is due is recomputed from the sequence when the step comes)."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, list[Sequence]] = {}

    def file(self, seq: Sequence, step: int) -> None:
        """Look at ``seq`` after decode-row step ``step``."""
        entries = self._entries.get(step)
        if entries is None:
            self._entries[step] = [seq]
        else:
            entries.append(seq)

    def file_rows(
        self,
        rows: list[Sequence],
        upcoming: int,
        block_size: int,
        length_limit: Callable[[Sequence], int],
    ) -> None:
        """File new rows, whose next token decode-row step ``upcoming`` computes: under the
        step that fills their last block and the step that reaches their length limit."""
        file = self.file
        for seq in rows:
            # The step computing position p is `upcoming + p - position` (position: that of
            # the next token).
            start = upcoming - len(seq.token_ids) + 1
            file(seq, start + len(seq.block_table) * block_size - 1)
            file(seq, start + length_limit(seq) - 2)

    def pop(self, step: int) -> list[Sequence]:
        """The sequences filed under ``step`` (then forgotten)."""
        return self._entries.pop(step, [])

    def clear(self) -> None:
        self._entries.clear()

    def check(
        self,
        rows: list[Sequence],
        upcoming: int,
        *,
        opening: list[Sequence],
        length_due: list[Sequence],
        block_size: int,
        length_limit: Callable[[Sequence], int],
    ) -> None:
        """Raise ``AssertionError`` unless each row is filed under its next due steps (its
        block filling up, unless ``opening`` one already; its length limit, unless
        ``length_due`` at it in the plan in flight)."""
        for seq in rows:
            position = seq.num_computed_tokens
            due = [upcoming + length_limit(seq) - 2 - position]
            if seq not in opening:
                due.append(upcoming + len(seq.block_table) * block_size - 1 - position)
            for step in due:
                if step < upcoming and seq in length_due:
                    continue  # at its limit in the plan in flight: finishes when recorded
                if seq not in self._entries.get(step, ()):
                    raise AssertionError(f"{seq!r} is not filed under decode-row step {step}")


def sort_in_running_order(seqs: list[Sequence], running: list[Sequence]) -> None:
    """Sort ``seqs`` (running sequences) in place, in ``running``'s order."""
    if len(seqs) <= 8:
        if len(seqs) > 1:
            seqs.sort(key=running.index)
        return
    order = {id(seq): index for index, seq in enumerate(running)}
    seqs.sort(key=lambda seq: order[id(seq)])


class DecodeRows:
    """The rows of the decoding sequences, in running order, and what is due after each
    decode-row step.

    A sequence that starts decoding *joins* (:meth:`join`): it gets its row when the next
    decode-row step is planned (:meth:`update`). Rows that left or moved since a plan was
    made make the rows *stale*: they are rebuilt from the running sequences before the next
    decode-row step, and that plan's record goes row by row.
    """

    __slots__ = (
        "_allocator",
        "_length_due",
        "_moved_on_removals",
        "_needs_block",
        "_planned_version",
        "_register_due",
        "_stops",
        "batch",
        "block_size",
        "calendar",
        "joining",
        "stale",
        "steps_done",
        "stop_ids",
    )

    def __init__(self, allocator: BlockAllocator, stops: StopRules) -> None:
        self._allocator = allocator
        self._stops = stops
        self.block_size = allocator.block_size
        self.batch = DecodeBatch(self.block_size, allocator.num_groups)
        self.joining: list[Sequence] = []  # started decoding; rows from the next step on
        self.stale = False  # the rows must be rebuilt before the next decode-row step
        self.stop_ids: frozenset[int] = frozenset()  # any row's stop tokens
        # Decode-row steps (decode or mixed) moved past, and the sequences to look at after
        # decode-row step N.
        self.steps_done = 0
        self.calendar = DecodeCalendar()
        self._needs_block: list[Sequence] = []  # rows whose last block filled up
        self._planned_version = -1  # the batch's version when the latest plan was made
        # After moving a plan's rows on: the batch's removal count then (-1: not in bulk);
        # the rows whose last block filled up (registered when recorded) and those at their
        # length limit (finished when recorded).
        self._moved_on_removals = -1
        self._register_due: list[Sequence] = []
        self._length_due: list[Sequence] = []

    @property
    def seqs(self) -> list[Sequence]:
        """The sequences with a row, in row order (not a copy)."""
        return self.batch.seqs

    # ----------------------------------------------------------- membership
    def join(self, seq: Sequence) -> None:
        """``seq`` starts decoding: one token per step from now on, a row from the next
        decode-row step."""
        seq.start_decoding()
        self.joining.append(seq)

    def leave(self, seq: Sequence) -> None:
        """``seq`` (decoding) leaves the running sequences: its row and bookkeeping go."""
        if seq in self.joining:
            self.joining.remove(seq)
        elif not self.stale:
            self.batch.remove(seq)
        if seq in self._needs_block:
            self._needs_block.remove(seq)
        seq.stop_decoding()

    # ------------------------------------------------------------- planning
    def blocks_needed(self, running: list[Sequence]) -> list[Sequence]:
        """The decoding sequences whose next token opens a block, in running order (the
        order a pass over the rows takes): the loop gives each one (:meth:`grew`) or
        preempts. Asked once per decode-row step."""
        opens_block = self._allocator.opens_block
        if self.stale:
            needs = [seq for seq in running if seq.decoding and opens_block(seq)]
        else:
            needs = self._needs_block
            needs.extend(seq for seq in self.joining if opens_block(seq))
            sort_in_running_order(needs, running)
        self._needs_block = []
        return needs

    def grew(self, seq: Sequence) -> None:
        """``seq`` got the block of its next token."""
        if not self.stale and seq not in self.joining:
            self.batch.grew(seq)
        # Look at it again when this block is full in turn.
        self.calendar.file(seq, self.steps_done + self.block_size)

    def update(self, running: list[Sequence]) -> bool:
        """Rows for the sequences that joined (or all of them, rebuilt, when stale); False
        when there are none."""
        if self.joining and not self.stale:
            self._add_joining(running)
        if self.stale:
            self._rebuild(running)
        return bool(self.batch.seqs)

    def planned(self) -> None:
        """A plan was made from the rows as they are now."""
        self._planned_version = self.batch.version

    def carried(self, in_flight: BatchPlan) -> tuple[array[int], array[int]]:
        """``(carried_rows, carried_samples)`` of a plan of these rows made while
        ``in_flight`` (moved on by :meth:`move_on`) runs."""
        only_appended = not self.stale and self.batch.removals == self._moved_on_removals
        return carried_rows(in_flight, self.batch, only_appended=only_appended)

    def _add_joining(self, running: list[Sequence]) -> None:
        """Rows after the existing ones when the joining sequences come later in running
        order (the usual case); otherwise the rows go stale."""
        joining = self.joining
        sort_in_running_order(joining, running)
        rows = self.batch.seqs
        if rows and running.index(rows[-1]) > running.index(joining[0]):
            self.stale = True  # an older chunked prefill finished after newer ones
            return
        self.batch.extend(joining)
        self._file(joining)
        self.joining = []

    def _rebuild(self, running: list[Sequence]) -> None:
        """Rows for every decoding sequence, and their calendar entries from now on."""
        rows = [seq for seq in running if seq.decoding]
        self.batch.rebuild(rows)
        self.stale = False
        self.joining = []
        self.stop_ids = frozenset()
        self._file(rows)

    def _file(self, rows: list[Sequence]) -> None:
        """File new rows in the calendar; add their stop tokens to the rows' union."""
        self.stop_ids = self._stops.stop_ids(rows, self.stop_ids)
        upcoming = self.steps_done + 1
        self.calendar.file_rows(rows, upcoming, self.block_size, self._stops.length_limit)

    # ------------------------------------------------------- move on, record
    def move_on(
        self, plan: BatchPlan, tokens: list[int] | None, known: dict[int, Sequence]
    ) -> None:
        """Move ``plan``'s decode rows on by one token each: their ``tokens``, or (``None``,
        planning ahead) :data:`~pagedinfer.domain.plan.PENDING_TOKEN`. ``known``: the
        unfinished sequences by id."""
        self._moved_on_removals = -1
        num_rows = plan.num_decode_rows
        if not num_rows:
            return
        self.steps_done += 1
        batch = self.batch
        if not self.stale and batch.version == self._planned_version:
            # The rows are the plan's decode rows: move them all on at once.
            if tokens is None:
                batch.advance_pending()
            else:
                batch.advance(tokens if len(tokens) == num_rows else tokens[:num_rows])
            self._moved_on_removals = batch.removals
            self._file_due(self.calendar.pop(self.steps_done))
        else:  # rows left since the plan was made (aborts): one by one, then rebuild
            self.calendar.pop(self.steps_done)
            self.stale = True
            for seq_id in plan.seq_ids[:num_rows]:
                seq = known.get(seq_id)
                if seq is not None and seq.status is SequenceStatus.RUNNING:
                    seq.token_ids.append(PENDING_TOKEN)

    def _file_due(self, filed: list[Sequence]) -> None:
        """The rows filed under the decode-row step just moved past: those whose last block
        filled up (registered when recorded, given a block later) or that reached their
        length limit (finished when recorded)."""
        opens_block = self._allocator.opens_block
        length_limit = self._stops.length_limit
        for seq in filed:
            if not seq.decoding or seq.status is not SequenceStatus.RUNNING:
                continue  # a stale entry: the sequence left the rows since it was filed
            if opens_block(seq) and seq not in self._needs_block:
                self._register_due.append(seq)
                self._needs_block.append(seq)
            if seq.num_tokens >= length_limit(seq):
                self._length_due.append(seq)

    def refresh(self, seq: Sequence) -> None:
        """``seq``'s tables changed in place (a sliding window freed blocks): its decode row,
        if it has one, copies them again."""
        if seq in self.batch.seqs:
            self.batch.refresh_table(seq)

    def record(
        self,
        plan: BatchPlan,
        tokens: list[int],
        known: dict[int, Sequence],
        *,
        filled: bool,
    ) -> tuple[list[Sequence], dict[Sequence, FinishReason]]:
        """Record ``plan``'s decode rows, moved on by :meth:`move_on` (``filled``: with
        their ``tokens``; else pending): ``(the sequences that got a token, in row order;
        those that finish on it, with why)``. The loop finishes them."""
        register_due, self._register_due = self._register_due, []
        length_due, self._length_due = self._length_due, []
        batch = self.batch
        register = self._allocator.register_full_blocks
        finishing: dict[Sequence, FinishReason]
        if not self.stale and batch.removals == self._moved_on_removals:
            # Every row is still there, in order: one pass over arrays, one set intersection.
            if not filled:
                batch.fill_pending(tokens)
            updated = batch.seqs[: len(tokens)]  # a copy: finishing removes rows
            finishing = self._stops.scan(updated, tokens, self.stop_ids)
            for seq in register_due:
                if seq.status is SequenceStatus.RUNNING:
                    register(seq)  # its last block filled up
                    if self._allocator.frees_in_place:  # a sliding window: blocks left
                        batch.refresh_table(seq)
            length_limit = self._stops.length_limit
            for seq in length_due:
                if (
                    seq.status is SequenceStatus.RUNNING
                    and seq not in finishing
                    and seq.num_tokens >= length_limit(seq)
                ):
                    finishing[seq] = FinishReason.LENGTH
            return updated, finishing
        # Rows left or moved (preempted, aborted, rebuilt): one by one, then rebuild (the
        # rows' inputs still hold the pending tokens).
        self.stale = True
        updated = []
        finishing = {}
        for seq_id, token in zip(plan.seq_ids[: len(tokens)], tokens, strict=True):
            row_seq = known.get(seq_id)
            if row_seq is None or row_seq.token_ids[-1] != PENDING_TOKEN:
                continue  # finished since (its token is discarded)
            row_seq.token_ids[-1] = token
            updated.append(row_seq)
            if row_seq.status is SequenceStatus.RUNNING:
                register(row_seq)
            reason = self._stops.finish_reason(row_seq, token)
            if reason is not None:
                finishing[row_seq] = reason
        return updated, finishing

    def roll_back(
        self, plan: BatchPlan, known: dict[int, Sequence], running: list[Sequence]
    ) -> None:
        """``plan``, moved on ahead of its tokens, was never recorded (nor the plan after
        it): its rows lose their pending token, and every decode row the blocks past its
        next token's (the rows move from block to block on the assumption that the next
        one is given when reached). Rebuilt from the sequences before the next step."""
        num_rows = plan.num_decode_rows
        if num_rows:
            self.steps_done -= 1
            for seq_id in plan.seq_ids[:num_rows]:
                seq = known.get(seq_id)
                if seq is not None and seq.token_ids[-1] == PENDING_TOKEN:
                    seq.token_ids.pop()
        self._register_due = []
        self._length_due = []
        self._needs_block = []
        size = self.block_size
        for seq in running:
            if seq.decoding:
                self._allocator.trim(seq, seq.num_computed_tokens // size + 1)
        self.joining = [seq for seq in self.joining if seq.decoding]
        self.stale = True  # rows, their calendar and inputs: rebuilt from the sequences

    # ------------------------------------------------------------ integrity
    def check(self, running: list[Sequence]) -> None:
        """Raise ``AssertionError`` unless the rows are the running decoders in order (the
        joining ones aside), the rows needing a block are filed, and the calendar holds
        every row under its next due steps. Nothing to check while stale."""
        if self.stale:
            return
        batch = self.batch
        joining = set(map(id, self.joining))
        if len(joining) != len(self.joining) or any(not seq.decoding for seq in self.joining):
            raise AssertionError(f"joining {self.joining} holds duplicates or non-decoders")
        if batch.seqs != [seq for seq in running if seq.decoding and id(seq) not in joining]:
            raise AssertionError("the decode rows are not the running decoders in order")
        batch.check()
        opening = [seq for seq in batch.seqs if self._allocator.opens_block(seq)]
        if sorted(map(id, opening)) != sorted(map(id, self._needs_block)):
            raise AssertionError(f"rows needing a block {opening} != filed {self._needs_block}")
        self.calendar.check(
            batch.seqs,
            self.steps_done + 1,
            opening=opening,
            length_due=self._length_due,
            block_size=self.block_size,
            length_limit=self._stops.length_limit,
        )
