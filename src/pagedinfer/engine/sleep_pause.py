"""The engine's controls for training loops: sleep and wake, pause and resume.

* :meth:`SleepAndPause.sleep` frees the KV cache (level 1; on CUDA the weights move to host
  memory) or the KV cache and the weights (level 2), vLLM's levels
  (``adapters/sleep_mode.py``). It needs an engine with no unfinished request: a step that
  ran while the cache is gone would read garbage. While asleep, a new request raises
  :class:`~pagedinfer.errors.EngineSleepingError` at once (never waits: no call hangs).
  :meth:`SleepAndPause.wake_up` takes the memory back (level 2: the checkpoint is loaded
  again); the prefix cache starts empty.
* :meth:`SleepAndPause.pause_generation` stops the engine between two steps: it returns once
  the step running (and, with async scheduling, the step in flight) has ended, and no step
  starts until :meth:`SleepAndPause.resume_generation`. Requests keep their place and their
  KV blocks; new ones queue. A ``generate`` or stream on another thread waits meanwhile; on
  the thread that paused it would wait for itself and raises
  :class:`~pagedinfer.errors.EnginePausedError` instead; ``step()`` runs nothing.

Everything here runs under the engine's lock (``engine_lock.py``). The methods are a mixin
of :class:`~pagedinfer.Engine`; the step loop asks :class:`GenerationControls` whether it may
start a step.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable

from pagedinfer.adapters.executor import ModelExecutor
from pagedinfer.adapters.sleep_mode import check_sleep_level, check_wake_tags
from pagedinfer.domain.scheduler import Scheduler
from pagedinfer.engine.engine_lock import EngineLock
from pagedinfer.engine.in_flight import InFlight
from pagedinfer.engine.request_table import RequestTable
from pagedinfer.errors import (
    EngineClosedError,
    EnginePausedError,
    EngineSleepingError,
    EngineStateError,
    StepFailedError,
)

__all__ = ["DEFAULT_PAUSE_TIMEOUT_S", "GenerationControls", "SleepAndPause"]

DEFAULT_PAUSE_TIMEOUT_S = 60.0
"""How long :meth:`SleepAndPause.pause_generation` waits for the running step by default."""


class GenerationControls:
    """Whether the engine is paused, and by which thread (read under the engine's lock)."""

    __slots__ = ("paused", "paused_by")

    def __init__(self) -> None:
        self.paused = False
        self.paused_by: int | None = None

    def check_not_pausing_thread(self) -> None:
        """Raise if the calling thread paused the engine (waiting would wait for itself)."""
        if self.paused and self.paused_by == threading.get_ident():
            raise EnginePausedError(
                "this thread paused the engine (pause_generation()) and now waits for a "
                "request: call resume_generation() first, or wait from another thread."
            )


class SleepAndPause:
    """:class:`~pagedinfer.Engine`'s sleep/wake and pause/resume methods."""

    # The Engine's state these methods use (set in Engine.__init__).
    _guard: EngineLock
    _controls: GenerationControls
    _executor: ModelExecutor | None
    _table: RequestTable
    _flights: InFlight
    _stepping: bool
    scheduler: Scheduler

    def _check_open(self) -> None:
        raise NotImplementedError  # the Engine's

    def _step(self) -> bool:
        raise NotImplementedError  # the Engine's

    # ---------------------------------------------------------------- sleep
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (``level=1``; on CUDA the weights are copied to host memory and
        their device memory freed too) or the KV cache and the weights (``level=2``; waking
        up loads the checkpoint again). The memory goes back to the device (CUDA's caching
        allocator is emptied; on the CPU the tensors are freed). Waits for a step that
        another thread is running. Raises :class:`~pagedinfer.errors.EngineStateError` if
        requests are unfinished (finish or abort them first). Asleep already, a higher level
        does the rest; a lower one nothing more. See docs/sleep_mode.md."""
        level = check_sleep_level(level)
        with self._guard.held():
            self._check_open()
            self._wait_for_steps(timeout=None)
            if self._table:
                raise EngineStateError(
                    f"sleep() needs an idle engine, but {len(self._table)} request(s) are "
                    "unfinished: wait for them or abort them, then call sleep()."
                )
            executor = self._running_executor()
            self.scheduler.reset_prefix_cache()  # the cached blocks' contents go
            executor.sleep(level)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Take back what :meth:`sleep` freed. ``tags``: ``None`` (everything), or a list of
        ``"weights"`` and ``"kv_cache"`` to wake one half (vLLM's tags: weights first, then
        the cache, so that new weights can be pushed before the cache takes its memory).
        After level 2 the weights come from the checkpoint directory again. The KV cache
        comes back empty (the prefix cache too). Awake already: nothing happens."""
        wake: list[str] = list(check_wake_tags(tags))
        with self._guard.held():
            self._check_open()
            executor = self._running_executor()
            executor.wake_up(wake)
            if not executor.is_sleeping:
                self.scheduler.reset_prefix_cache()

    def is_sleeping(self) -> bool:
        """Whether any part of the engine (weights or KV cache) is asleep."""
        with self._guard.held():
            executor = self._executor
            return executor is not None and executor.is_sleeping

    # ---------------------------------------------------------------- pause
    def pause_generation(self, timeout: float | None = DEFAULT_PAUSE_TIMEOUT_S) -> None:
        """Stop between two steps: return once the running step (and a step in flight) has
        ended; start no step until :meth:`resume_generation`. Unfinished requests keep their
        state; new ones queue. Raises ``TimeoutError`` (and stays unpaused) if the running
        step does not end within ``timeout`` seconds (``None``: no limit). Paused already:
        returns at once."""
        with self._guard.held():
            self._check_open()
            controls = self._controls
            if controls.paused:
                return
            controls.paused = True
            controls.paused_by = threading.get_ident()
            try:
                self._wait_for_steps(timeout=timeout)
            except BaseException:
                controls.paused = False
                controls.paused_by = None
                self._guard.notify_all()
                raise

    def resume_generation(self) -> None:
        """Let steps run again (waiting ``generate`` calls and streams go on). Not paused:
        nothing happens."""
        with self._guard.held():
            controls = self._controls
            controls.paused = False
            controls.paused_by = None
            self._guard.notify_all()

    def is_paused(self) -> bool:
        """Whether :meth:`pause_generation` holds the engine."""
        with self._guard.held():
            return self._controls.paused

    # -------------------------------------------------------------- helpers
    def _check_accepting(self) -> None:
        """Refuse a new request while asleep (under the lock)."""
        executor = self._executor
        if executor is not None and executor.is_sleeping:
            raise EngineSleepingError(
                "the engine is asleep (sleep() freed its KV cache or weights): call "
                "wake_up() before submitting requests."
            )

    def _running_executor(self) -> ModelExecutor:
        executor = self._executor
        if executor is None:
            raise EngineClosedError("the engine is closed; create a new Engine.")
        return executor

    def _wait_for_steps(self, *, timeout: float | None) -> None:
        """Wait until no step runs in another thread and none is in flight (async
        scheduling: the one launched ahead is run to its end here, and none is launched
        after it while paused or with no request left)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._stepping or self._flights:
            if not self._stepping:  # a step in flight and nobody waits for it: land it
                with contextlib.suppress(StepFailedError):  # reported to the consumers
                    self._step()
                continue
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"the running step did not end within {timeout} s; the engine was not "
                    "paused. Try again, or pass a longer timeout."
                )
            self._guard.wait_for_change(remaining)
            self._check_open()
