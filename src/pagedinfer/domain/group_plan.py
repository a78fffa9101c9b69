"""The block tables and KV slots of a plan's other KV groups (hybrid attention).

A plan is built from group 0's tables (``Sequence.block_table``, the decode rows' persistent
arrays); with several KV groups (:mod:`pagedinfer.domain.kv_groups`) the scheduler adds the
other groups' tables and slots with :func:`with_group_tables`, from the sequences as they are
when the plan is made. One table per group keeps the plain path (one group) untouched.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Mapping
from itertools import chain

from pagedinfer.domain.plan import BLOCK_TABLE_FILLER, BatchPlan
from pagedinfer.domain.sequence import Sequence

__all__ = ["group_slots", "with_group_tables"]


def group_slots(out: array[int], table: list[int], start: int, end: int, block_size: int) -> None:
    """Append the KV slots of positions ``start .. end - 1`` through ``table``."""
    position = start
    while position < end:
        index = position // block_size
        stop = min(end, (index + 1) * block_size)
        base = (table[index] - index) * block_size  # slot of position p: base + p
        out.extend(range(base + position, base + stop))
        position = stop


def with_group_tables(plan: BatchPlan, seqs: Mapping[int, Sequence], num_groups: int) -> BatchPlan:
    """``plan`` with the tables and slots of groups ``1 .. num_groups - 1`` of its rows'
    sequences (``seqs``: by id)."""
    width = plan.block_table_width
    size = plan.block_size
    rows = [seqs[seq_id].group_block_tables for seq_id in plan.seq_ids]
    num_decode = plan.num_decode_rows  # one token each: token r is row r
    decode_positions = plan.positions[:num_decode].tolist()
    cu_q = plan.cu_seqlens_q
    context_lens = plan.context_lens
    # Every group's table of a sequence has the same length: one filler run per row.
    fillers = [[BLOCK_TABLE_FILLER] * (width - len(row[0])) for row in rows]
    tables = []
    slot_mappings = []
    for group in range(num_groups - 1):
        group_tables = [row[group] for row in rows]
        flat = array("i")
        flat.fromlist(
            list(chain.from_iterable(chain.from_iterable(zip(group_tables, fillers, strict=True))))
        )
        tables.append(flat)
        slots = array(
            "q",
            [
                table[position // size] * size + position % size
                for table, position in zip(group_tables, decode_positions, strict=False)
            ],
        )
        for row in range(num_decode, len(group_tables)):
            end = context_lens[row]
            group_slots(slots, group_tables[row], end - (cu_q[row + 1] - cu_q[row]), end, size)
        slot_mappings.append(slots)
    return dataclasses.replace(
        plan, group_block_tables=tuple(tables), group_slot_mappings=tuple(slot_mappings)
    )
