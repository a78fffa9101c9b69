"""Steps in flight (engine/in_flight.py): launched in order on one worker thread, carried
tokens filled in on the host only for executors that do not read them themselves."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from pagedinfer.domain.executor import launch_now
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.scheduler import Scheduler, SchedulerConfig
from pagedinfer.domain.sequence import Sequence
from pagedinfer.domain.step_output import StepOutput
from pagedinfer.engine.in_flight import InFlight, with_carried_tokens


class RecordingExecutor:
    """Samples token ``100 + row``; records each plan's input ids and the launching thread."""

    num_kv_blocks = 16

    def __init__(self, *, reads_carried_tokens: bool, fail_on: int = 0) -> None:
        self.reads_carried_tokens = reads_carried_tokens
        self.launched: list[tuple[int, list[int], str]] = []
        self.fail_on = fail_on

    def execute(self, plan: BatchPlan) -> StepOutput:
        self.launched.append((plan.step_id, list(plan.input_ids), threading.current_thread().name))
        if plan.step_id == self.fail_on:
            raise RuntimeError("injected")
        return StepOutput([100 + row for row in range(len(plan.sampled_seq_ids))])

    def launch(self, plan: BatchPlan) -> Callable[[], StepOutput]:
        return launch_now(self.execute, plan)

    def close(self) -> None:
        pass


def _plans() -> tuple[BatchPlan, BatchPlan]:
    """A decode plan and the plan made ahead of its tokens (both rows carried)."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    scheduler.add(Sequence(0, [5, 6, 7], params))
    scheduler.add(Sequence(1, [8, 9], params))
    prefill = scheduler.schedule()
    assert prefill is not None
    scheduler.postprocess(prefill, [11, 12])
    decode = scheduler.schedule()
    ahead = scheduler.schedule_ahead()
    assert decode is not None and ahead is not None
    assert list(ahead.carried_rows) == [0, 1]
    return decode, ahead


@pytest.mark.parametrize("reads", [False, True])
def test_steps_launch_in_order_on_the_worker_thread(reads: bool) -> None:
    decode, ahead = _plans()
    executor = RecordingExecutor(reads_carried_tokens=reads)
    flights = InFlight()
    first = flights.launch(executor, decode)
    second = flights.launch(executor, ahead)
    assert len(flights) == 2 and flights.oldest is first
    assert first.wait()[0].sampled_token_ids == [100, 101]
    flights.landed()
    assert flights.oldest is second
    second.wait()
    flights.landed()
    assert len(flights) == 0
    (step1, ids1, thread1), (step2, ids2, thread2) = executor.launched
    assert (step1, step2) == (decode.step_id, ahead.step_id)
    assert ids1 == [11, 12]
    # Filled in on the host from the previous step's samples, unless the executor reads them.
    assert ids2 == (list(ahead.input_ids) if reads else [100, 101])
    assert thread1 == thread2 != threading.current_thread().name
    worker = flights.close()
    assert worker is not None
    worker.shutdown(wait=True)


def test_a_failed_step_fails_the_step_that_carries_its_tokens() -> None:
    decode, ahead = _plans()
    executor = RecordingExecutor(reads_carried_tokens=False, fail_on=decode.step_id)
    flights = InFlight()
    first = flights.launch(executor, decode)
    second = flights.launch(executor, ahead)
    with pytest.raises(RuntimeError, match="injected"):
        first.wait()
    with pytest.raises(RuntimeError, match="injected"):  # it waited for the failed one
        second.wait()
    assert flights.drop() == [decode, ahead]
    assert len(flights) == 0
    assert [step for step, _, _ in executor.launched] == [decode.step_id]
    worker = flights.close()
    assert worker is not None
    worker.shutdown(wait=True)


def test_with_carried_tokens_fills_the_carried_rows() -> None:
    _, ahead = _plans()
    filled = with_carried_tokens(ahead, StepOutput([21, 22]))
    assert list(filled.input_ids) == [21, 22]
    assert not filled.carried_rows and not filled.carried_samples
    assert list(ahead.input_ids) != [21, 22]  # the plan itself is not modified


def test_close_without_a_step_has_no_worker() -> None:
    assert InFlight().close() is None
