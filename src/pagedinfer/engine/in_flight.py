"""Steps in flight (async scheduling): launched on a worker thread, not recorded yet.

:class:`InFlight` holds at most two steps, oldest first: the one the host waits for and the
one planned ahead of it (``Scheduler.schedule_ahead``). One worker thread launches them in
order through :meth:`ModelExecutor.launch <pagedinfer.adapters.executor.ModelExecutor.launch>`
while the engine's thread plans and records; an executor that overlaps steps (``ModelRunner``)
returns before its step ends, so the next one queues up behind it on the device.

A plan made ahead has *carried rows* whose input is a token the previous step samples. An
executor that ``reads_carried_tokens`` writes them in on its device; for the others this
module, and only this module, fills them in on the host once the previous step's output is
back (:func:`with_carried_tokens`).
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pagedinfer.adapters.executor import ModelExecutor
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.step_output import StepOutput

__all__ = ["Flight", "InFlight", "with_carried_tokens"]


@dataclass(frozen=True, slots=True)
class Flight:
    """A step launched on the worker thread and not recorded yet."""

    plan: BatchPlan
    # What reads its output, and when the worker thread started it (perf_counter).
    future: Future[tuple[Callable[[], StepOutput], float]]

    def wait(self) -> tuple[StepOutput, float]:
        """The step's output and its seconds since it started; raises what it raised."""
        read_output, started = self.future.result()
        output = read_output()  # waits for this step only
        return output, time.perf_counter() - started


class InFlight:
    """The launched, unrecorded steps, oldest first, and the thread that launches them."""

    def __init__(self) -> None:
        self._flights: deque[Flight] = deque()
        self._worker: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self._flights)

    def __iter__(self) -> Iterator[Flight]:
        return iter(self._flights)

    @property
    def oldest(self) -> Flight:
        return self._flights[0]

    def launch(self, executor: ModelExecutor, plan: BatchPlan) -> Flight:
        """Queue ``plan`` on the worker thread, after the steps in flight (the newest of
        which it carries tokens of, if it was planned ahead of them)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedinfer-step")
        previous = self._flights[-1] if self._flights else None
        host_carry = bool(plan.carried_rows) and not executor.reads_carried_tokens
        if host_carry:
            assert previous is not None, "a plan with carried rows follows the step it carries"

        def run() -> tuple[Callable[[], StepOutput], float]:
            started = time.perf_counter()
            ready = plan
            if host_carry:  # the executor cannot read them on its device: fill them in here
                assert previous is not None
                read_previous = previous.future.result()[0]
                ready = with_carried_tokens(plan, read_previous())
            return executor.launch(ready), started

        flight = Flight(plan, self._worker.submit(run))
        self._flights.append(flight)
        return flight

    def landed(self) -> None:
        """The oldest step was recorded: forget it."""
        self._flights.popleft()

    def drop(self) -> list[BatchPlan]:
        """Forget every step in flight (one failed): cancel those not started yet; their
        plans, oldest first."""
        plans = [flight.plan for flight in self._flights]
        for flight in self._flights:
            flight.future.cancel()
        self._flights.clear()
        return plans

    def close(self) -> ThreadPoolExecutor | None:
        """Forget every step and hand back the worker thread (to shut down outside the
        engine's lock: a step still running ends first)."""
        self._flights.clear()
        worker, self._worker = self._worker, None
        return worker


def with_carried_tokens(plan: BatchPlan, previous: StepOutput) -> BatchPlan:
    """``plan`` with its carried rows' input ids filled in from the previous step's samples
    (for executors that do not read them from their device)."""
    input_ids = array("q", plan.input_ids)
    sampled = previous.sampled_token_ids
    for row, sample in zip(plan.carried_rows, plan.carried_samples, strict=True):
        input_ids[row] = sampled[sample]
    return dataclasses.replace(
        plan, input_ids=input_ids, carried_rows=array("q"), carried_samples=array("q")
    )
