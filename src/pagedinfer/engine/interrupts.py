"""Ctrl-C at a safe point: hold ``KeyboardInterrupt`` back while engine state changes.

Python runs signal handlers between any two bytecodes of the main thread, so a
``KeyboardInterrupt`` could land between two statements that only make sense together (the
scheduler finishing a request and the engine recording it), leaving a request orphaned. While
the engine changes its bookkeeping, SIGINT only sets a flag here; the interrupt is raised at
the next safe point instead: before the engine waits (a model step, another thread's step),
or when the locked region ends. Long waits stay interruptible.

Only the main thread is affected (signals reach no other), and only while SIGINT has
Python's default handler: a handler the program installed itself is left alone. The handler
swap costs about a microsecond; the previous handler is always put back.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

__all__ = ["InterruptDeferral"]


class InterruptDeferral:
    """Defers SIGINT from construction until :meth:`end`; :meth:`suspend` / :meth:`resume`
    let it through around an interruptible wait."""

    __slots__ = ("_active", "_deferring", "_pending")

    def __init__(self, *, active: bool = True) -> None:
        self._active = (
            active
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        self._pending = False
        self._deferring = False
        self.resume()

    @classmethod
    def inactive(cls) -> InterruptDeferral:
        """One that defers nothing (a placeholder)."""
        return cls(active=False)

    def suspend(self) -> None:
        """Let Ctrl-C through again; raise one that arrived while deferred (a safe point)."""
        if self._deferring:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._deferring = False
        self._raise_pending()

    def resume(self) -> None:
        """Defer Ctrl-C again (after an interruptible wait)."""
        if self._active and not self._deferring:
            signal.signal(signal.SIGINT, self._defer)
            self._deferring = True

    def end(self, *, raise_pending: bool = True) -> None:
        """Stop deferring; raise a deferred Ctrl-C unless another exception is on its way."""
        if self._deferring:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._deferring = False
        if raise_pending:
            self._raise_pending()

    def _defer(self, signum: int, frame: FrameType | None) -> None:
        self._pending = True

    def _raise_pending(self) -> None:
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt
