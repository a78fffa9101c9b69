"""Progress lines for long property runs (``make fuzz``).

A thorough run spends minutes inside one test with ``pytest -q`` printing nothing. While
``PAGEDINFER_PROPERTY_PROGRESS`` is set (``make fuzz`` sets it to 30), every property test in
this folder reports to the terminal, every that many seconds, how many examples it has run
and for how long, and one last line when it ends::

    [property] test_engine_machine.py::TestEngineMachine::runTest: 212 examples, 2m30s

Examples are counted where Hypothesis runs them: for a ``@given`` test, its inner test
(``test.hypothesis.inner_test``, the hook Hypothesis offers plugins); for a state machine
(``Machine.TestCase``), each new machine instance. The lines go to pytest's terminal with
output capturing suspended for the line (:func:`terminal_writer`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

PROGRESS_ENV = "PAGEDINFER_PROPERTY_PROGRESS"


def progress_interval() -> float | None:
    """Seconds between progress lines, or None when progress is off."""
    raw = os.environ.get(PROGRESS_ENV, "").strip()
    if not raw or raw == "0":
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(
            f"{PROGRESS_ENV}={raw!r} is not a number of seconds: set it to e.g. 30, or unset it."
        ) from None
    if not seconds > 0:
        raise ValueError(f"{PROGRESS_ENV}={raw!r} must be positive (seconds between lines).")
    return seconds


def _format_elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class ExampleCounter:
    """Counts examples of one test and writes a line every ``interval`` seconds."""

    def __init__(self, name: str, interval: float, write: Callable[[str], None]) -> None:
        self.name = name
        self.count = 0
        self._interval = interval
        self._write = write
        self._start = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._report_until_done, daemon=True)

    def line(self) -> str:
        elapsed = _format_elapsed(time.monotonic() - self._start)
        return f"[property] {self.name}: {self.count} examples, {elapsed}"

    def _report_until_done(self) -> None:
        while not self._done.wait(self._interval):
            self._write(self.line())

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._write(self.line() + " (done)")


def terminal_writer(config: pytest.Config) -> Callable[[str], None]:
    """Writes a line to pytest's terminal even while the test's output is captured."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    lock = threading.Lock()

    def write(text: str) -> None:
        with lock:
            if capture is not None:
                with capture.global_and_fixture_disabled():
                    _write_line(reporter, text)
            else:
                _write_line(reporter, text)

    return write


def _write_line(reporter: Any, text: str) -> None:
    if reporter is not None:
        reporter.write_line(text)
    else:
        sys.stderr.write(text + "\n")


def _state_machine_class(item: pytest.Item) -> type[Any] | None:
    """The machine behind a ``Machine.TestCase`` test item, or None."""
    cls = getattr(item, "cls", None)
    if cls is None or not cls.__qualname__.endswith(".TestCase"):
        return None
    machine_name = cls.__qualname__.removesuffix(".TestCase")
    module = getattr(item, "module", None)  # the test file (the TestCase's own is Hypothesis's)
    machine = getattr(module, machine_name, None)
    return machine if isinstance(machine, type) else None


@contextmanager
def counting_examples(
    item: pytest.Item,
    monkeypatch: pytest.MonkeyPatch,
    interval: float,
    write: Callable[[str], None],
) -> Iterator[ExampleCounter | None]:
    """Count ``item``'s examples and report them while the body runs (None: not a property
    test this can count)."""
    counter = ExampleCounter(item.nodeid.rsplit("/", 1)[-1], interval, write)

    def counted(run: Callable[..., Any]) -> Callable[..., Any]:
        def run_counted(*args: Any, **kwargs: Any) -> Any:
            counter.count += 1
            return run(*args, **kwargs)

        return run_counted

    machine = _state_machine_class(item)
    hypothesis_handle = getattr(getattr(item, "obj", None), "hypothesis", None)
    if machine is not None:
        monkeypatch.setattr(machine, "__init__", counted(machine.__init__))
    elif hypothesis_handle is not None:
        monkeypatch.setattr(hypothesis_handle, "inner_test", counted(hypothesis_handle.inner_test))
    else:
        yield None
        return
    counter.start()
    try:
        yield counter
    finally:
        counter.stop()
