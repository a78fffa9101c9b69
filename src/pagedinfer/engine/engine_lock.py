"""The engine's lock: one thread at a time changes the engine's state, with Ctrl-C held back
while it does (``interrupts.py``).

A thread holds the lock for bookkeeping (:meth:`EngineLock.held`), lets it go while the model
runs (:meth:`EngineLock.released`, Ctrl-C let through meanwhile), and waits for another
thread's step to end (:meth:`EngineLock.wait_for_change`, woken by
:meth:`EngineLock.notify_all`: a step ended, a request was finalized outside a step, or the
engine closed).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from pagedinfer.engine.interrupts import InterruptDeferral

__all__ = ["EngineLock"]


class EngineLock:
    """The lock, its condition, and the Ctrl-C deferral of the thread that holds it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)
        self.deferral = InterruptDeferral.inactive()  # of the thread that holds the lock

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock, with Ctrl-C held back until the end (or the next wait)."""
        with self.lock:
            deferral = InterruptDeferral()
            self.deferral = deferral
            try:
                yield
            except BaseException:
                deferral.end(raise_pending=False)
                raise
            deferral.end()

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Let other threads in (and Ctrl-C through) while this thread runs the model."""
        deferral = self.deferral
        deferral.suspend()
        self.lock.release()
        try:
            yield
        finally:
            deferral.resume()  # before acquiring, so Ctrl-C cannot break off the acquire
            self.lock.acquire()
            self.deferral = deferral

    def wait_for_change(self, timeout: float | None = None) -> None:
        """Wait (the lock released) until another thread calls :meth:`notify_all`, or at
        most ``timeout`` seconds."""
        deferral = self.deferral
        deferral.suspend()
        try:
            self._changed.wait(timeout)
        finally:
            self.deferral = deferral
            deferral.resume()

    def notify_all(self) -> None:
        """Wake the waiting threads (call with the lock held)."""
        self._changed.notify_all()

    def surface_interrupt(self) -> None:
        """Raise a held-back Ctrl-C now (before delivering outputs)."""
        self.deferral.suspend()
