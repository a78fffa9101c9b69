"""Every executor the engine can get declares whether it reads carried tokens and launches a
step in two halves (ModelExecutor); the ones that do not overlap steps run it at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pagedinfer.adapters.distributed.executor import TensorParallelExecutor
from pagedinfer.adapters.distributed.ray_executor import RayExecutor
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.domain.executor import launch_now
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.step_output import StepOutput


@pytest.mark.parametrize(
    ("executor", "reads"),
    [(ModelRunner, True), (TensorParallelExecutor, False), (RayExecutor, False)],
)
def test_each_executor_declares_the_protocol(executor: Any, reads: bool) -> None:
    assert executor.reads_carried_tokens is reads
    assert callable(executor.launch) and callable(executor.execute)


def test_launch_now_runs_the_step_before_returning() -> None:
    calls: list[object] = []
    output = StepOutput([7])

    def execute(plan: BatchPlan) -> StepOutput:
        calls.append(plan)
        return output

    plan: BatchPlan = object()  # type: ignore[assignment]  # only passed through
    read: Callable[[], StepOutput] = launch_now(execute, plan)
    assert calls == [plan]
    assert read() is output and read() is output
    assert calls == [plan]  # reading runs nothing


def test_launch_now_raises_what_execute_raised() -> None:
    def execute(plan: BatchPlan) -> StepOutput:
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        launch_now(execute, object())  # type: ignore[arg-type]
