"""The decoding sequences as persistent rows: a decode step's arrays, kept from step to step.

Every running sequence whose prompt is done computes exactly one token per decode step, so
from one step to the next almost nothing about its row changes: its position, context length
and KV slot grow by one, its input token is the one just sampled, its block table and
sampling slot stay. :class:`DecodeBatch` keeps those arrays between steps and moves every row
on at once (:meth:`DecodeBatch.advance`), so a decode step costs a few C-level passes over
arrays instead of Python work per sequence. Rows change individually only when a sequence
starts decoding (:meth:`~DecodeBatch.extend`, after a prefill step), leaves
(:meth:`~DecodeBatch.remove`) or opens a new block (:meth:`~DecodeBatch.grew`).
:meth:`~DecodeBatch.rebuild` lays the rows out from scratch: the scheduler's fallback, and the
reference the incremental state is checked against (:meth:`~DecodeBatch.check`).

With several KV groups (hybrid attention, :mod:`pagedinfer.domain.kv_groups`) the rows keep
every group's tables and slots alike: all of a sequence's tables have the same length, so
the groups share the width, grow together, and only a sliding window's freeing (in place,
:meth:`~DecodeBatch.refresh_table`) changes one group's row without the others.
"""

from __future__ import annotations

import sys
from array import array
from collections import deque
from itertools import accumulate, repeat

from pagedinfer.domain.plan import (
    BLOCK_TABLE_FILLER,
    PADDING_SLOT,
    PENDING_TOKEN,
    BatchPlan,
    NewRequest,
)
from pagedinfer.domain.sequence import Sequence

__all__ = ["DecodeBatch"]

_BYTE_ORDER = sys.byteorder  # arrays are in native byte order


def _pack(addends: array[int]) -> int:
    """The array's bytes read as one unsigned integer: addends for :func:`_add_lanes`."""
    return int.from_bytes(addends, _BYTE_ORDER)


def _add_lanes(values: array[int], lanes: int) -> array[int]:
    """A new array: ``values[i]`` plus entry ``i`` of ``lanes``, the packed addends
    (:func:`_pack` of an array of ``values``' type and length).

    Read as one unsigned integer, an array's bytes hold each entry in its own bit field (a
    "lane"); adding the packed addends adds to every entry at once, in one big-integer
    addition at C speed instead of a Python loop over the rows. This is exact because every
    value and every sum here (positions, lengths, KV slots, prefix sums) is non-negative and
    fits its field, so no carry ever crosses into the next entry.
    """
    total = int.from_bytes(values, _BYTE_ORDER) + lanes
    return array(values.typecode, total.to_bytes(len(values) * values.itemsize, _BYTE_ORDER))


class _RowConstants:
    """What depends only on the number of rows ``n``; rebuilt (cheaply) when it changes."""

    __slots__ = ("arange_i", "arange_q", "num_rows", "ones_i", "ones_q", "ramp_i")

    def __init__(self, num_rows: int, count_q: array[int], count_i: array[int]) -> None:
        # count_q / count_i count 0, 1, 2, ... far enough: slicing them is a memcpy.
        self.num_rows = num_rows
        self.arange_q = count_q[:num_rows]  # sample_indices of a decode step
        self.arange_i = count_i[: num_rows + 1]  # cu_seqlens_q of a decode step
        self.ones_q = _pack(array("q", [1]) * num_rows)  # +1 for every int64 row entry
        self.ones_i = _pack(array("i", [1]) * num_rows)  # +1 for every int32 row entry
        self.ramp_i = _pack(self.arange_i)  # +i for prefix-sum entry i


class DecodeBatch:
    """Rows of the sequences in decode, in the scheduler's running order.

    Row ``i`` describes the token sequence ``seqs[i]`` computes next: ``positions[i]`` is
    ``len(token_ids) - 1``, ``context_lens[i]`` is ``len(token_ids)``, ``input_ids[i]`` is its
    last token and ``slot_mapping[i]`` where that token's K/V go, through the row's block
    table (``block_tables``, ``width`` entries per row, the longest table's length). The
    exception: a row whose next token opens a new block has a stale slot until the scheduler
    gives it the block and calls :meth:`grew`.

    The rows hold the sequences' ``token_ids`` lists, so the scheduler must append to them,
    never replace them, while a sequence decodes.

    ``num_groups`` KV groups: ``group_block_tables[g - 1]`` and ``group_slot_mappings[g - 1]``
    are group ``g``'s (from ``seq.group_block_tables``), laid out as group 0's. The groups'
    slots live in one array, row-major (``[rows, num_groups - 1]``), so a step moves them all
    on in one addition.
    """

    def __init__(self, block_size: int, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        self.group_block_tables: list[array[int]] = [array("i") for _ in range(num_groups - 1)]
        self._group_slots = array("q")  # [rows, num_groups - 1], row-major
        self._group_ones = 0  # packed +1 for every entry of _group_slots
        self.seqs: list[Sequence] = []
        self._token_lists: list[list[int]] = []
        self.seq_ids = array("q")
        self.sample_slots = array("i")
        self.input_ids = array("q")
        self.positions = array("q")
        self.context_lens = array("i")
        self.slot_mapping = array("q")
        self.cu_seqlens_k = array("i", [0])
        self.max_context_len = 0
        self.block_tables = array("i")
        self.width = 0
        self._row_blocks = array("i")
        self._count_q = array("q", range(64))
        self._count_i = array("i", range(65))
        self._rows = _RowConstants(0, self._count_q, self._count_i)
        self.version = 0  # changes whenever rows are added or removed
        self.removals = 0  # changes whenever rows are removed or laid out again (reordered)

    def __len__(self) -> int:
        return len(self.seqs)

    # ------------------------------------------------------------ whole batch
    def rebuild(self, seqs: list[Sequence]) -> None:
        """Rows for ``seqs`` (decoding sequences, in running order), from scratch."""
        self.removals += 1
        self.seqs = []
        self._token_lists = []
        self.seq_ids = array("q")
        self.sample_slots = array("i")
        self.input_ids = array("q")
        self.positions = array("q")
        self.context_lens = array("i")
        self.slot_mapping = array("q")
        self.block_tables = array("i")
        self.group_block_tables = [array("i") for _ in range(self.num_groups - 1)]
        self._group_slots = array("q")
        self.width = 0
        self._row_blocks = array("i")
        self.extend(seqs)

    def extend(self, seqs: list[Sequence]) -> None:
        """Rows for ``seqs`` (decoding sequences, in running order) after the existing rows.

        A row whose next token opens a block it does not hold yet gets ``PADDING_SLOT``; the
        scheduler gives it the block (and calls :meth:`grew`) before the step is planned.
        """
        size = self.block_size
        tokens = [seq.token_ids for seq in seqs]
        lengths = list(map(len, tokens))
        positions = [length - 1 for length in lengths]
        self.seqs += seqs
        self._token_lists += tokens
        self.seq_ids.fromlist([seq.seq_id for seq in seqs])
        self.sample_slots.fromlist([seq.slot for seq in seqs])
        self.input_ids.fromlist([row[-1] for row in tokens])
        self.positions.fromlist(positions)
        self.context_lens.fromlist(lengths)
        self.slot_mapping.fromlist(
            [_slot(seq.block_table, p, size) for seq, p in zip(seqs, positions, strict=True)]
        )
        if self.num_groups > 1:
            self._group_slots.fromlist(
                [
                    _slot(table, p, size)
                    for seq, p in zip(seqs, positions, strict=True)
                    for table in seq.group_block_tables
                ]
            )
        counts = [len(seq.block_table) for seq in seqs]
        self._row_blocks.fromlist(counts)
        if max(counts, default=0) > self.width:
            self._lay_out_tables(max(counts))
        else:
            width = self.width
            for seq, count in zip(seqs, counts, strict=True):
                filler = [BLOCK_TABLE_FILLER] * (width - count)
                self.block_tables.fromlist(seq.block_table)
                self.block_tables.fromlist(filler)
                for tables, table in zip(
                    self.group_block_tables, seq.group_block_tables, strict=True
                ):
                    tables.fromlist(table)
                    tables.fromlist(filler)
        self._rows_changed()

    def advance(self, tokens: list[int]) -> None:
        """Record a decode step of every row: append its sampled token, move it on by one."""
        input_ids = array("q", tokens)  # checks the tokens before anything changes
        if len(input_ids) != len(self.seqs):
            raise ValueError(f"{len(input_ids)} sampled tokens for {len(self.seqs)} rows")
        # list.append returns None; a zero-length deque drains the map at C speed.
        deque(map(list.append, self._token_lists, tokens), maxlen=0)
        self._move_on(input_ids)

    def advance_pending(self) -> None:
        """:meth:`advance` before the step's tokens are known (the scheduler plans the next
        step ahead of them): every row's next token is :data:`PENDING_TOKEN` until
        :meth:`fill_pending` writes it."""
        num_rows = len(self.seqs)
        deque(map(list.append, self._token_lists, repeat(PENDING_TOKEN, num_rows)), maxlen=0)
        self._move_on(array("q", [PENDING_TOKEN]) * num_rows)

    def fill_pending(self, tokens: list[int]) -> None:
        """The sampled tokens of the first ``len(tokens)`` rows, which :meth:`advance_pending`
        left pending: into their sequences and into the rows' inputs."""
        num_rows = len(tokens)
        values = array("q", tokens)  # checks the tokens before anything changes
        assert num_rows <= len(self.seqs), (num_rows, len(self.seqs))
        deque(
            map(list.__setitem__, self._token_lists[:num_rows], repeat(-1, num_rows), tokens),
            maxlen=0,
        )
        self.input_ids[:num_rows] = values

    def _move_on(self, input_ids: array[int]) -> None:
        rows = self._rows
        self.input_ids = input_ids
        self.positions = _add_lanes(self.positions, rows.ones_q)
        self.slot_mapping = _add_lanes(self.slot_mapping, rows.ones_q)
        if self._group_ones:
            self._group_slots = _add_lanes(self._group_slots, self._group_ones)
        self.context_lens = _add_lanes(self.context_lens, rows.ones_i)
        self.cu_seqlens_k = _add_lanes(self.cu_seqlens_k, rows.ramp_i)
        self.max_context_len += 1

    def plan(
        self,
        *,
        released_slots: tuple[int, ...],
        new_requests: tuple[NewRequest, ...],
        block_copies: tuple[tuple[int, int], ...] = (),
        step_id: int = 0,
        recorded_step_id: int = 0,
        made_ahead: bool = False,
        carried_rows: array[int] | None = None,
        carried_samples: array[int] | None = None,
    ) -> BatchPlan:
        """This step as a :class:`BatchPlan` (copies: later steps never change a plan), with
        the deltas and header given (see :func:`~pagedinfer.domain.plan.build_batch_plan`)."""
        num_rows = len(self.seqs)
        rows = self._rows
        return BatchPlan(
            is_prefill=False,
            block_size=self.block_size,
            seq_ids=self.seq_ids[:],
            query_lens=array("i", [1]) * num_rows,
            context_lens=self.context_lens[:],
            cu_seqlens_q=rows.arange_i[:],
            cu_seqlens_k=self.cu_seqlens_k[:],
            max_seqlen_q=1,
            max_seqlen_k=self.max_context_len,
            block_tables=self.block_tables[:],
            block_table_width=self.width,
            input_ids=self.input_ids[:],
            positions=self.positions[:],
            slot_mapping=self.slot_mapping[:],
            sample_indices=rows.arange_q[:],
            sample_slots=self.sample_slots[:],
            released_slots=released_slots,
            new_requests=new_requests,
            block_copies=block_copies,
            step_id=step_id,
            recorded_step_id=recorded_step_id,
            made_ahead=made_ahead,
            carried_rows=array("q") if carried_rows is None else carried_rows,
            carried_samples=array("q") if carried_samples is None else carried_samples,
            group_block_tables=tuple(tables[:] for tables in self.group_block_tables),
            group_slot_mappings=tuple(self.group_slot_mappings),
        )

    # ------------------------------------------------------------- single rows
    def remove(self, seq: Sequence) -> None:
        """Drop ``seq``'s row (it finished, was aborted or preempted)."""
        row = self.seqs.index(seq)
        del self.seqs[row]
        del self._token_lists[row]
        for values in (
            self.seq_ids,
            self.sample_slots,
            self.input_ids,
            self.positions,
            self.context_lens,
            self.slot_mapping,
        ):
            del values[row]
        others = self.num_groups - 1
        del self._group_slots[row * others : (row + 1) * others]
        width = self.width
        for tables in (self.block_tables, *self.group_block_tables):
            del tables[row * width : (row + 1) * width]
        blocks = self._row_blocks.pop(row)
        self.removals += 1
        if blocks == width:  # it may have been the longest row: tables may get narrower
            self._lay_out_tables(max(self._row_blocks, default=0))
        self._rows_changed()

    def grew(self, seq: Sequence) -> None:
        """``seq`` got a new block at the end of its table: copy it into its row, fix its slot."""
        row = self.seqs.index(seq)
        count = len(seq.block_table)
        if count > self.width:
            self._lay_out_tables(count)
        else:
            entry = row * self.width + count - 1
            self.block_tables[entry] = seq.block_table[-1]
            for tables, table in zip(self.group_block_tables, seq.group_block_tables, strict=True):
                tables[entry] = table[-1]
        self._row_blocks[row] = count
        position = self.positions[row]
        size = self.block_size
        self.slot_mapping[row] = _slot(seq.block_table, position, size)
        others = self.num_groups - 1
        self._group_slots[row * others : (row + 1) * others] = array(
            "q", [_slot(table, position, size) for table in seq.group_block_tables]
        )

    def refresh_table(self, seq: Sequence) -> None:
        """``seq``'s tables changed in place (a sliding window freed their first blocks):
        copy them into its row again."""
        row = self.seqs.index(seq)
        start = row * self.width
        end = start + len(seq.block_table)
        self.block_tables[start:end] = array("i", seq.block_table)
        for tables, table in zip(self.group_block_tables, seq.group_block_tables, strict=True):
            tables[start:end] = array("i", table)

    @property
    def group_slot_mappings(self) -> list[array[int]]:
        """Each other group's slots, group 1 first (new arrays)."""
        others = self.num_groups - 1
        return [self._group_slots[group::others] for group in range(others)]

    def block_table_row(self, row: int) -> list[int]:
        """Row ``row`` of ``block_tables``, filler entries included."""
        return self.block_tables[row * self.width : (row + 1) * self.width].tolist()

    # ---------------------------------------------------------------- checking
    def check(self) -> None:
        """Raise ``AssertionError`` unless every array equals a from-scratch rebuild.

        The slot of a row whose next token opens a block it does not hold yet is stale by
        design (see the class docstring) and not compared. O(rows); for tests.
        """
        fresh = DecodeBatch(self.block_size, self.num_groups)
        fresh.rebuild(self.seqs)
        for group, (slots, fresh_slots) in enumerate(
            zip(
                (self.slot_mapping, *self.group_slot_mappings),
                (fresh.slot_mapping, *fresh.group_slot_mappings),
                strict=True,
            )
        ):
            for row, slot in enumerate(fresh_slots):
                if slot != PADDING_SLOT and slot != slots[row]:
                    raise AssertionError(
                        f"group {group}, row {row}: slot {slots[row]} != recomputed {slot}"
                    )
        for name in (
            "seq_ids",
            "sample_slots",
            "input_ids",
            "positions",
            "context_lens",
            "cu_seqlens_k",
            "block_tables",
            "group_block_tables",
            "width",
            "max_context_len",
            "_row_blocks",
        ):
            if getattr(self, name) != getattr(fresh, name):
                raise AssertionError(
                    f"DecodeBatch.{name} {getattr(self, name)!r} != recomputed "
                    f"{getattr(fresh, name)!r}"
                )
        if any(
            tokens is not seq.token_ids
            for tokens, seq in zip(self._token_lists, self.seqs, strict=True)
        ):
            raise AssertionError("a row holds a token list its sequence no longer uses")

    # ---------------------------------------------------------------- private
    def _lay_out_tables(self, width: int) -> None:
        flat: list[list[int]] = [[] for _ in range(self.num_groups)]
        for seq in self.seqs:
            filler = [BLOCK_TABLE_FILLER] * (width - len(seq.block_table))
            for out, table in zip(flat, (seq.block_table, *seq.group_block_tables), strict=True):
                out.extend(table)
                out.extend(filler)
        self.block_tables = array("i", flat[0])
        self.group_block_tables = [array("i", tables) for tables in flat[1:]]
        self.width = width

    def _rows_changed(self) -> None:
        self.cu_seqlens_k = array("i", accumulate(self.context_lens, initial=0))
        self.max_context_len = max(self.context_lens, default=0)
        num_rows = len(self.seqs)
        if self._rows.num_rows != num_rows:
            if num_rows >= len(self._count_q):
                size = 2 * num_rows
                self._count_q = array("q", range(size))
                self._count_i = array("i", range(size + 1))
            self._rows = _RowConstants(num_rows, self._count_q, self._count_i)
            others = self.num_groups - 1
            self._group_ones = _pack(array("q", [1]) * (num_rows * others)) if others else 0
        self.version += 1


def _slot(table: list[int], position: int, block_size: int) -> int:
    """The KV slot of ``position``; ``PADDING_SLOT`` if its block is not in ``table`` yet."""
    index, offset = divmod(position, block_size)
    return table[index] * block_size + offset if index < len(table) else PADDING_SLOT
