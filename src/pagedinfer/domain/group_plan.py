"""The block tables and KV slots of a prefill plan's other KV groups (hybrid attention).

A plan is built from group 0's tables (``Sequence.block_table``); with several KV groups
(:mod:`pagedinfer.domain.kv_groups`) it also carries the other groups' tables and slots.
Decode rows keep theirs in the rows' persistent arrays
(:class:`~pagedinfer.domain.decode_batch.DecodeBatch`); the chunks of a prefill plan get
theirs here (:func:`chunk_group_tables`, called by
:func:`~pagedinfer.domain.plan.build_batch_plan`). A leaf module: the plan module imports it.
"""

from __future__ import annotations

from array import array
from itertools import chain

__all__ = ["chunk_group_tables", "group_slots"]


def group_slots(out: array[int], table: list[int], start: int, end: int, block_size: int) -> None:
    """Append the KV slots of positions ``start .. end - 1`` through ``table``."""
    position = start
    while position < end:
        index = position // block_size
        stop = min(end, (index + 1) * block_size)
        base = (table[index] - index) * block_size  # slot of position p: base + p
        out.extend(range(base + position, base + stop))
        position = stop


def chunk_group_tables(
    rows: list[list[list[int]]],
    spans: list[tuple[int, int]],
    num_groups: int,
    width: int,
    block_size: int,
    filler: int,
) -> tuple[tuple[array[int], ...], tuple[array[int], ...]]:
    """``(tables, slots)`` of groups ``1 .. num_groups - 1`` for chunks whose sequences hold
    the ``group_block_tables`` ``rows`` and compute positions ``start .. end - 1``
    (``spans``): each group's tables ``[len(rows), width]`` (``filler``-padded, row-major)
    and slots."""
    # Every group's table of a sequence has the same length: one filler run per row.
    fillers = [[filler] * (width - len(row[0])) for row in rows]
    tables = []
    slot_mappings = []
    for group in range(num_groups - 1):
        group_tables = [row[group] for row in rows]
        flat = array("i")
        flat.fromlist(
            list(chain.from_iterable(chain.from_iterable(zip(group_tables, fillers, strict=True))))
        )
        tables.append(flat)
        slots = array("q")
        for table, (start, end) in zip(group_tables, spans, strict=True):
            group_slots(slots, table, start, end, block_size)
        slot_mappings.append(slots)
    return tuple(tables), tuple(slot_mappings)
