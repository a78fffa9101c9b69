"""Ctrl-C at a safe point: hold ``KeyboardInterrupt`` back while engine state changes.

Python runs signal handlers between any two bytecodes of the main thread, so a
``KeyboardInterrupt`` could land between two statements that only make sense together (the
scheduler finishing a request and the engine recording it), leaving a request orphaned. While
the engine changes its bookkeeping, SIGINT only sets a flag here; the interrupt is raised at
the next safe point instead: before the engine waits (a model step, another thread's step),
or when the locked region ends. Long waits stay interruptible.

Only the main thread is affected (signals reach no other), and only while SIGINT has
Python's default handler: a handler the program installed itself is left alone. The handler
is installed once per locked region and Python's default is always put back at its end; in
between, letting Ctrl-C through around a wait (every step) only flips a flag: the handler
then raises at once, as the default does (``signal.signal`` costs microseconds a call).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

__all__ = ["InterruptDeferral"]


class InterruptDeferral:
    """Defers SIGINT from construction until :meth:`end`; :meth:`suspend` / :meth:`resume`
    let it through around an interruptible wait."""

    __slots__ = ("_active", "_deferring", "_installed", "_pending")

    def __init__(self, *, active: bool = True) -> None:
        self._active = (
            active
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        self._pending = False
        self._deferring = False
        self._installed = False
        self.resume()

    @classmethod
    def inactive(cls) -> InterruptDeferral:
        """One that defers nothing (a placeholder)."""
        return cls(active=False)

    def suspend(self) -> None:
        """Let Ctrl-C through again; raise one that arrived while deferred (a safe point)."""
        self._deferring = False
        self._raise_pending()

    def resume(self) -> None:
        """Defer Ctrl-C again (after an interruptible wait)."""
        if self._active:
            self._deferring = True  # first: a Ctrl-C from now on is held back
            if not self._installed:
                signal.signal(signal.SIGINT, self._on_sigint)
                self._installed = True

    def end(self, *, raise_pending: bool = True) -> None:
        """Stop deferring; raise a deferred Ctrl-C unless another exception is on its way."""
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._installed = False
        self._deferring = False
        if raise_pending:
            self._raise_pending()

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if not self._deferring:
            raise KeyboardInterrupt  # suspended: what Python's default handler does
        self._pending = True

    def _raise_pending(self) -> None:
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt
