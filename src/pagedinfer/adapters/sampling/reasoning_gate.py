"""A grammar matcher that starts after a thinking model's reasoning (``reasoning_end``).

:class:`ReasoningGate` wraps a request's grammar matcher: until one of the reasoning-end
tokens (:class:`~pagedinfer.domain.reasoning.ReasoningEnd`) has been consumed, every token is
allowed (its bitmask row is all ones) and consumed tokens do not reach the grammar; from the
token after the end token on, the wrapped matcher masks and consumes as usual, from its start
state. Rolling back across the end token closes the gate again, so an undone step (a step
that runs again) leaves the matcher as it was.
"""

from __future__ import annotations

import ctypes
from typing import Any

from pagedinfer.domain.reasoning import ReasoningEnd

__all__ = ["ReasoningGate", "gated"]


class ReasoningGate:
    """``inner`` (a grammar matcher) behind a gate that opens after an end token."""

    __slots__ = ("_consumed", "_end_ids", "_inner", "_opened_at")

    def __init__(self, inner: Any, end: ReasoningEnd) -> None:
        self._inner = inner
        self._end_ids = frozenset(end.token_ids)
        self._consumed = 0  # tokens consumed, before the gate and after it
        self._opened_at: int | None = None  # tokens consumed when the end token was

    @property
    def open(self) -> bool:
        """Whether the reasoning has ended (the grammar applies)."""
        return self._opened_at is not None

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        if self._opened_at is None:
            ctypes.memset(pointer, 0xFF, size)  # every token allowed
        else:
            self._inner.unsafe_compute_mask_ptr(pointer, size)

    def is_error(self) -> bool:
        return self._opened_at is not None and bool(self._inner.is_error())

    def get_error(self) -> str:
        return str(self._inner.get_error())

    def stop_reason(self) -> str:
        return str(self._inner.stop_reason())

    def consume_token(self, token: int) -> bool:
        if self._opened_at is not None:
            if not self._inner.consume_token(token):
                return False
        elif token in self._end_ids:
            self._opened_at = self._consumed + 1
        self._consumed += 1
        return True

    def rollback(self, num_tokens: int) -> bool:
        num_tokens = min(num_tokens, self._consumed)
        if self._opened_at is not None:
            inner = min(num_tokens, self._consumed - self._opened_at)
            if inner and not self._inner.rollback(inner):
                return False
        self._consumed -= num_tokens
        if self._opened_at is not None and self._consumed < self._opened_at:
            self._opened_at = None
        return True


def gated(matcher: Any, end: ReasoningEnd | None) -> Any:
    """``matcher`` behind a :class:`ReasoningGate` when the constraint has a reasoning end."""
    return matcher if end is None else ReasoningGate(matcher, end)
