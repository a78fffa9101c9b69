"""Planned-ahead (async) scheduling: which rows of a plan made ahead take their input from
the plan still in flight.

:meth:`Scheduler.schedule_ahead` plans the next step before the plan in flight's sampled
tokens are known: each of its decode rows whose input is such a token holds
:data:`~pagedinfer.domain.plan.PENDING_TOKEN`, and the plan names those rows
(``carried_rows``) and the sample of the plan in flight each one takes
(``carried_samples``). This module answers that question from the decode rows alone; the
scheduler's loop moves its state on and back (``_move_on``, ``_roll_back``: the decode rows
by :meth:`~pagedinfer.domain.scheduler.rows.DecodeRows.move_on` and ``roll_back``); the
chunks it counted are restored by :func:`restore_chunks`.
"""

from __future__ import annotations

from array import array

from pagedinfer.domain.block_pool import cdiv
from pagedinfer.domain.decode_batch import DecodeBatch
from pagedinfer.domain.plan import PENDING_TOKEN, BatchPlan
from pagedinfer.domain.scheduler.allocator import BlockAllocator
from pagedinfer.domain.sequence import Sequence, SequenceStatus

__all__ = ["carried_rows", "restore_chunks"]


def carried_rows(
    in_flight: BatchPlan, rows: DecodeBatch, *, only_appended: bool
) -> tuple[array[int], array[int]]:
    """``(carried_rows, carried_samples)`` of a plan whose decode rows are ``rows`` (their
    state now), made while ``in_flight`` runs. ``only_appended``: rows were only appended
    since ``in_flight``'s were moved on, so its decode rows lead, in order (no search)."""
    num_rows = in_flight.num_decode_rows
    if num_rows == 0 or not rows.seqs:
        return array("q"), array("q")
    if only_appended:
        assert len(rows.seqs) >= num_rows, (len(rows.seqs), num_rows)
        leading = array("q", range(num_rows))
        return leading, leading[:]
    index = {seq_id: j for j, seq_id in enumerate(in_flight.seq_ids[:num_rows])}
    carried = array("q")
    samples = array("q")
    seq_ids = rows.seq_ids
    for row, token in enumerate(rows.input_ids):
        if token == PENDING_TOKEN:
            carried.append(row)
            samples.append(index[seq_ids[row]])
    return carried, samples


def restore_chunks(
    advanced: list[tuple[Sequence, int, int]],
    known: dict[int, Sequence],
    allocator: BlockAllocator,
) -> None:
    """Undo the chunks a plan that was never recorded counted as computed: each
    ``(sequence, computed tokens before, its preemptions then)`` still running as then
    (``known``: the unfinished sequences by id) gets its count back, and keeps the blocks
    of the chunk that runs again, not those given for the one after."""
    size = allocator.block_size
    for seq, before, preemptions in advanced:
        if (
            seq.status is SequenceStatus.RUNNING
            and seq.num_preemptions == preemptions
            and seq.seq_id in known
        ):
            allocator.trim(seq, cdiv(seq.num_computed_tokens, size))
            seq.stop_decoding()  # (moving on may have made it decode)
            seq.num_computed_tokens = before
