"""``PooledState``: one pooling request's hidden states, added up as its prefill chunks run."""

from __future__ import annotations

from pagedinfer.domain.step_output import PooledChunk

__all__ = ["PooledState"]


class PooledState:
    """The pooled rows of one prompt so far: a sum and a row count (mean pooling), or the
    one row taken (last token, CLS). A chunk at position 0 starts again (a recomputation)."""

    __slots__ = ("num_rows", "total")

    def __init__(self) -> None:
        self.total: list[float] | None = None
        self.num_rows = 0

    def add(self, chunk: PooledChunk) -> None:
        if self.total is None or chunk.first_position == 0 or not chunk.summed:
            self.total = list(chunk.values)
            self.num_rows = chunk.num_rows
            return
        self.total = [a + b for a, b in zip(self.total, chunk.values, strict=True)]
        self.num_rows += chunk.num_rows

    def value(self) -> list[float] | None:
        """The pooled vector (the mean of the rows summed), or None before any chunk."""
        if self.total is None:
            return None
        return [x / self.num_rows for x in self.total]
