"""The progress reporter of long property runs counts the examples Hypothesis really runs."""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from .progress import counting_examples, progress_interval


class _CountedMachine(RuleBasedStateMachine):
    instances = 0

    def __init__(self) -> None:
        super().__init__()
        type(self).instances += 1

    @rule()
    def step(self) -> None:
        pass


_CountedMachineCase = _CountedMachine.TestCase
_CountedMachineCase.settings = settings(max_examples=7, stateful_step_count=2, database=None)


@settings(max_examples=9, database=None)
@given(st.integers())
def _given_test(value: int) -> None:
    pass


class _Item:
    def __init__(self, nodeid: str, obj: Any, cls: type[Any] | None = None) -> None:
        self.nodeid = nodeid
        self.obj = obj
        self.cls = cls
        self.module = sys.modules[__name__]


def test_a_given_test_reports_each_example(monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    item: Any = _Item("tests/property/x.py::_given_test", _given_test)
    with counting_examples(item, monkeypatch, interval=60.0, write=lines.append) as counter:
        _given_test()
    assert counter is not None
    assert counter.count >= 9  # Hypothesis may add its explicit/shrink runs, never fewer
    assert lines == [counter.line() + " (done)"]
    assert lines[0].startswith(f"[property] x.py::_given_test: {counter.count} examples, ")


def test_a_state_machine_reports_each_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    before = _CountedMachine.instances
    item: Any = _Item("x.py::_CountedMachineCase::runTest", None, _CountedMachineCase)
    with counting_examples(item, monkeypatch, interval=60.0, write=lines.append) as counter:
        _CountedMachineCase("runTest").runTest()
    assert counter is not None
    assert counter.count == _CountedMachine.instances - before >= 7


def test_lines_come_while_the_test_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    item: Any = _Item("x.py::_given_test", _given_test)
    with counting_examples(item, monkeypatch, interval=0.01, write=lines.append):
        time.sleep(0.1)
    assert len(lines) >= 3 and lines[-1].endswith("(done)")


def test_the_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDINFER_PROPERTY_PROGRESS", raising=False)
    assert progress_interval() is None
    monkeypatch.setenv("PAGEDINFER_PROPERTY_PROGRESS", "30")
    assert progress_interval() == 30.0
    monkeypatch.setenv("PAGEDINFER_PROPERTY_PROGRESS", "soon")
    with pytest.raises(ValueError, match="not a number of seconds"):
        progress_interval()
