"""Admission (engine/admission.py): the one check of sampling parameters, then queueing."""

from __future__ import annotations

from typing import Any

import pytest

from pagedinfer.domain.limits import RequestLimits
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.scheduler import Scheduler, SchedulerConfig
from pagedinfer.domain.structured import StructuredOutputsParams
from pagedinfer.engine import admission as admission_module
from pagedinfer.engine.admission import Admission
from pagedinfer.engine.prompts import TokenizedPrompt
from pagedinfer.engine.request_table import RequestTable
from pagedinfer.engine.requests import OutputSink
from pagedinfer.errors import InvalidRequestError

VOCAB = 100
EOS = 2


class CountingGrammars:
    """A grammar compiler that compiles anything and counts how often it did."""

    def __init__(self) -> None:
        self.num_compiled = 0

    def pinned(self, params: StructuredOutputsParams) -> object | None:
        return None  # no constraint carries one of ours: every unchecked one compiles

    def compile(self, params: StructuredOutputsParams) -> object:
        self.num_compiled += 1
        return object()


def _admission(
    grammars: Any = None, *, speculative: bool = False, limits: RequestLimits | None = None
) -> Admission:
    return Admission(
        limits=limits or RequestLimits(max_n=8, max_logprobs=5),
        max_running=4,
        vocab_size=VOCAB,
        eos_token_ids={EOS},
        grammars=grammars or CountingGrammars(),  # type: ignore[arg-type]
        speculative=speculative,
    )


def _scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32))


def test_the_limits_are_resolved_against_what_runs_and_the_vocabulary() -> None:
    assert _admission().limits == RequestLimits(max_n=4, max_logprobs=5)
    assert _admission(limits=RequestLimits(max_logprobs=-1)).limits.max_logprobs == VOCAB


def test_none_is_the_defaults() -> None:
    assert _admission().check(None) == SamplingParams()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(n=5), r"n=5 completions cannot run at once: at most .*=4"),
        (SamplingParams(logprobs=6), r"logprobs=6 exceeds max_logprobs=5"),
        (SamplingParams(stop_token_ids=[VOCAB]), r"names token id 100 .* \[0, 100\)"),
        (
            SamplingParams(allowed_token_ids=[EOS], min_tokens=1),
            "holds only EOS / stop tokens",
        ),
    ],
)
def test_what_the_engine_cannot_serve_is_refused(params: SamplingParams, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        _admission().check(params)


def test_anything_but_sampling_params_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="must be a SamplingParams, not dict"):
        _admission().check({"n": 1})  # type: ignore[arg-type]


def test_structured_outputs_with_speculative_decoding_are_refused() -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    with pytest.raises(InvalidRequestError, match="cannot run with speculative decoding"):
        _admission(speculative=True).check(params)


def test_params_passed_on_are_not_checked_again() -> None:
    grammars = CountingGrammars()
    admission = _admission(grammars)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    checked = admission.check(params)
    assert checked is not params and checked == params  # a copy carrying its grammar
    assert admission.check(checked) is checked
    assert admission.check(checked) is checked
    assert grammars.num_compiled == 1
    # An equal object that was not the one accepted is checked (and compiled) again.
    assert admission.check(params) == params
    assert grammars.num_compiled == 2


def test_an_admission_remembers_only_the_latest_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission_module, "REMEMBERED", 2)
    grammars = CountingGrammars()
    admission = _admission(grammars)
    checked = [
        admission.check(SamplingParams(structured_outputs=StructuredOutputsParams(regex=r)))
        for r in ("a", "b", "c")
    ]
    assert grammars.num_compiled == 3
    admission.check(checked[2])
    assert grammars.num_compiled == 3
    admission.check(checked[0])  # forgotten: checked again
    assert grammars.num_compiled == 4


def test_another_admissions_params_are_checked() -> None:
    grammars = CountingGrammars()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="x"))
    checked = _admission(grammars).check(params)
    _admission(grammars).check(checked)
    assert grammars.num_compiled == 2


def test_check_all_gives_one_per_prompt() -> None:
    admission = _admission()
    shared = SamplingParams(max_tokens=3)
    assert admission.check_all(3, shared) == [shared] * 3
    assert admission.check_all(2, None) == [SamplingParams()] * 2
    each = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=2)]
    assert admission.check_all(2, each) == each
    with pytest.raises(InvalidRequestError, match="got 2 SamplingParams for 3 prompts"):
        admission.check_all(3, each)


def test_enqueue_queues_one_sequence_per_completion() -> None:
    admission, scheduler, table = _admission(), _scheduler(), RequestTable()
    sink = OutputSink(wants_progress=False)
    prompt = TokenizedPrompt(None, (5, 6, 7))
    first = admission.enqueue(table, scheduler, None, prompt, SamplingParams(n=3), sink)
    second = admission.enqueue(table, scheduler, None, prompt, SamplingParams(), sink)
    assert (first.request_id, second.request_id) == (0, 3)  # ids advance by n
    assert [c.seq.seq_id for c in first.completions] == [0, 1, 2]
    assert set(table.requests) == {0, 3} and set(table.completions) == {0, 1, 2, 3}
    assert sink.num_unfinished == 2
    assert scheduler.get(0) is first.completions[0].seq


def test_a_request_the_scheduler_refuses_leaves_nothing_behind() -> None:
    admission, scheduler, table = _admission(), _scheduler(), RequestTable()
    sink = OutputSink(wants_progress=False)
    too_long = TokenizedPrompt(None, tuple(range(3, 40)))
    with pytest.raises(InvalidRequestError):
        admission.enqueue(table, scheduler, None, too_long, SamplingParams(), sink)
    assert not table.requests and sink.num_unfinished == 0
    ok = admission.enqueue(
        table, scheduler, None, TokenizedPrompt(None, (5,)), SamplingParams(), sink
    )
    assert ok.request_id == 0  # no id was spent on the refused one


def test_enqueue_all_is_all_or_nothing() -> None:
    admission, scheduler, table = _admission(), _scheduler(), RequestTable()
    sink = OutputSink(wants_progress=False)
    aborted: list[int] = []

    def abort(request_id: int) -> bool:
        aborted.append(request_id)
        return True

    prompts = [TokenizedPrompt(None, (5, 6)), TokenizedPrompt(None, tuple(range(3, 40)))]
    with pytest.raises(InvalidRequestError):
        admission.enqueue_all(table, scheduler, None, prompts, [SamplingParams()] * 2, sink, abort)
    assert aborted == [0]
