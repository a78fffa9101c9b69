"""Rank 0's handle on one worker process: start it, read its status, notice its death, stop it."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import Any

from pagedinfer.adapters.distributed.messages import FAILED
from pagedinfer.adapters.distributed.worker import WorkerSpec, run_worker
from pagedinfer.errors import WorkerDiedError

__all__ = ["WorkerHandle", "first_dead"]

POLL_SECONDS = 0.05


class WorkerHandle:
    """One spawned worker (rank >= 1) and the read end of its status pipe."""

    def __init__(self, context: SpawnContext, spec: WorkerSpec, status: Connection) -> None:
        self.rank = spec.rank
        self._status = status
        self._error_text: str | None = None
        self.process: SpawnProcess = context.Process(
            target=run_worker,
            args=(spec,),
            name=f"pagedinfer-tp-rank{spec.rank}",
            # Daemonic: even if nothing else runs, multiprocessing ends it at interpreter exit.
            daemon=True,
        )
        self.process.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def check_alive(self) -> None:
        """Raise :class:`WorkerDiedError` if the process has exited."""
        if not self.process.is_alive():
            raise self.died_error()

    def died_error(self) -> WorkerDiedError:
        """The error that describes this worker's exit (with its traceback, if it sent one)."""
        self._drain_status()
        code = self.process.exitcode
        if code is None:
            how = "stopped responding"
        elif code < 0:
            try:
                how = f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        message = (
            f"tensor-parallel worker rank {self.rank} (pid {self.pid}) {how}; the engine "
            "cannot continue: close it and create a new Engine."
        )
        if self._error_text:
            message += f"\nThe worker's error:\n{self._error_text.rstrip()}"
        return WorkerDiedError(message)

    def await_status(
        self, kind: str, *, check: Callable[[], None], deadline: float, late: str = ""
    ) -> tuple[Any, ...]:
        """The next status message, which must be ``kind``; calls ``check()`` while waiting.
        Past ``deadline``: :class:`WorkerDiedError` (``late``: its message)."""
        while True:
            ready = wait([self._status, self.process.sentinel], timeout=POLL_SECONDS)
            if self._status in ready:
                try:
                    message: tuple[Any, ...] = self._status.recv()
                except EOFError:
                    message = ()
                if message and message[0] == kind:
                    return message
                if message and message[0] == FAILED:
                    self._error_text = str(message[1])
                self.process.join(timeout=5.0)
                raise self.died_error()
            if self.process.sentinel in ready:
                raise self.died_error()
            check()
            if time.monotonic() > deadline:
                raise WorkerDiedError(
                    late
                    or f"tensor-parallel worker rank {self.rank} (pid {self.pid}) did not "
                    f"report {kind!r} in time; the engine cannot start."
                )

    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the process to exit, then terminate, then kill it."""
        process = self.process
        process.join(timeout)
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join()
        self._drain_status()
        self._status.close()

    def _drain_status(self) -> None:
        if self._status.closed:
            return
        try:
            while self._status.poll():
                message = self._status.recv()
                if message and message[0] == FAILED:
                    self._error_text = str(message[1])
        except (EOFError, OSError):
            pass


def first_dead(workers: list[WorkerHandle], grace: float) -> WorkerHandle | None:
    """The first worker that has exited or exits within ``grace`` seconds, else None."""
    deadline = time.monotonic() + grace
    while True:
        for worker in workers:
            if not worker.is_alive():
                return worker
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        wait([worker.process.sentinel for worker in workers], timeout=remaining)
