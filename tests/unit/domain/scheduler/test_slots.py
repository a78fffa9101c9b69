"""SlotTable: sampling slots and the deltas every plan repeats until one is recorded."""

from __future__ import annotations

import pytest

from pagedinfer.domain import BatchPlan, NewRequest, SamplingParams, Sequence, build_batch_plan
from pagedinfer.domain.scheduler.slots import SlotTable


def plan_with(released: tuple[int, ...], requests: tuple[NewRequest, ...]) -> BatchPlan:
    return build_batch_plan(
        [], is_prefill=True, block_size=4, released_slots=released, new_requests=requests
    )


def test_slots_are_reused_lowest_last_released_first() -> None:
    table = SlotTable()
    a, b, c = (Sequence(i, [1]) for i in range(3))
    table.assign(a)
    table.assign(b)
    assert (a.slot, b.slot) == (0, 1)
    table.release(a)
    assert a.slot == -1
    table.assign(c)
    assert c.slot == 0 and table.num_slots == 2


def test_deltas_repeat_until_confirmed() -> None:
    table = SlotTable()
    seq = Sequence(5, [1, 2], SamplingParams(repetition_penalty=1.2))
    table.assign(seq)
    released, requests = table.unconfirmed(None)
    assert released == ()
    assert [(r.seq_id, r.slot, r.prompt_token_ids) for r in requests] == [(5, 0, (1, 2))]
    table.confirm(plan_with(released, requests))
    assert table.unconfirmed(None) == ((), ())
    table.release(seq)
    assert table.unconfirmed(None) == ((0,), ())


def test_an_uninstalled_request_is_not_installed_after_its_release() -> None:
    table = SlotTable()
    seq = Sequence(0, [1])
    table.assign(seq)
    table.release(seq)
    assert table.unconfirmed(None) == ((0,), ())


def test_planning_ahead_leaves_out_what_the_plan_in_flight_carries() -> None:
    table = SlotTable()
    a, b = Sequence(0, [1]), Sequence(1, [1])
    table.assign(a)
    in_flight = plan_with(*table.unconfirmed(None))
    table.assign(b)
    released, requests = table.unconfirmed(in_flight)
    assert released == () and [r.seq_id for r in requests] == [1]


def test_check_finds_a_shared_slot() -> None:
    table = SlotTable()
    a, b = Sequence(0, [1]), Sequence(1, [1])
    table.assign(a)
    table.assign(b)
    table.check([a, b], [], [], limit=2)
    b.slot = 0
    with pytest.raises(AssertionError, match="share a sampling slot"):
        table.check([a, b], [], [], limit=2)
