"""The decode rows' calendar: which decoding sequences to look at after which step.

Every decoding sequence advances exactly one token in every step that has decode rows (a
*decode-row step*: a decode or a mixed step), so the step at which its last block fills up
and the step at which it reaches its length limit are known when it starts decoding. The
scheduler files it under those steps (:meth:`DecodeCalendar.file_rows`) and, after each
decode-row step, looks only at the sequences filed under it. The rows themselves are a
:class:`~pagedinfer.domain.decode_batch.DecodeBatch`.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedinfer.domain.sequence import Sequence

__all__ = ["DecodeCalendar", "sort_in_running_order"]


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
