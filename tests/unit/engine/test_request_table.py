"""The table of unfinished requests (engine/request_table.py)."""

from __future__ import annotations

from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.scheduler import Scheduler, SchedulerConfig
from pagedinfer.domain.sequence import Sequence
from pagedinfer.engine.request_table import RequestTable
from pagedinfer.engine.requests import CompletionState, OutputSink, RequestState


def _request(request_id: int, n: int = 1, *, wants_progress: bool = False) -> RequestState:
    request = RequestState(request_id, None, OutputSink(wants_progress=wants_progress))
    for index in range(n):
        seq = Sequence(request_id + index, [1, 2, 3], SamplingParams(n=n))
        request.completions.append(CompletionState(request, seq, None, streamed=False, index=index))
    return request


def test_add_and_forget_keep_the_counts() -> None:
    table = RequestTable()
    plain, following = _request(0, n=2), _request(2, wants_progress=True)
    table.add(plain, structured=True)
    table.add(following, structured=False)
    assert len(table) == 2 and set(table.completions) == {0, 1, 2}
    assert table.num_following == 1 and table.structured == {0}
    assert table.forget(plain)
    assert not table.forget(plain)  # once
    assert set(table.completions) == {2} and not table.structured
    assert table.forget(following)
    assert (len(table), table.num_following, table.num_finished) == (0, 0, 2)


def test_unfinished_in_names_the_requests_with_a_row_in_the_plans() -> None:
    table = RequestTable()
    requests = [_request(0), _request(1), _request(2)]
    for request in requests:
        table.add(request, structured=False)
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=2, max_model_len=32)
    )
    for request in (requests[2], requests[0], requests[1]):  # only the first two run
        scheduler.add(request.completions[0].seq)
    plan = scheduler.schedule()
    assert plan is not None
    assert table.unfinished_in([plan]) == [requests[2], requests[0]]  # by first row
    requests[2].final = requests[2].output()  # finalized already: not failed again
    assert table.unfinished_in([plan]) == [requests[0]]
