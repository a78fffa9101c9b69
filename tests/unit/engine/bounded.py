"""Run a test body with a deadline, so that a hang fails the test instead of the whole run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEADLINE_SECONDS = 60.0


def within(function: Callable[[], T], seconds: float = DEADLINE_SECONDS) -> T:
    """``function()``'s result, or a test failure if it has not returned after ``seconds``.

    The body runs in a daemon thread: a hung body keeps spinning there (the engine it uses
    is lost), but the test fails and the session goes on.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(function())
        except BaseException as exc:  # re-raised in the test's thread
            error.append(exc)

    thread = threading.Thread(target=run, daemon=True, name="bounded-test-body")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"did not finish within {seconds} s (a hang)")
    if error:
        raise error[0]
    return result[0]
