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
    tables = [array("i") for _ in range(num_groups - 1)]
    slots = [array("q") for _ in range(num_groups - 1)]
    context_lens = plan.context_lens
    query_lens = plan.query_lens
    for row, seq_id in enumerate(plan.seq_ids):
        seq = seqs[seq_id]
        end = context_lens[row]
        start = end - query_lens[row]
        for group, table in enumerate(seq.group_block_tables):
            out = tables[group]
            out.fromlist(table)
            if len(table) < width:
                out.fromlist([BLOCK_TABLE_FILLER] * (width - len(table)))
            group_slots(slots[group], table, start, end, size)
    return dataclasses.replace(
        plan, group_block_tables=tuple(tables), group_slot_mappings=tuple(slots)
    )
