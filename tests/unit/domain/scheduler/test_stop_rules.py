"""When the scheduler ends a request: max_tokens=None, min_tokens, EOS and stop tokens, and
which reason wins when a stop token is also the last token allowed."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SeqABC

import pytest

from pagedinfer.domain import FinishReason, SamplingParams, Scheduler, SchedulerConfig, Sequence
from pagedinfer.domain.scheduler.stop_rules import StopRules

from ..driver import constant_sampler, run_to_completion, step

EOS = 7


def scheduler(max_model_len: int = 32) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=32, block_size=4, max_model_len=max_model_len, eos_token_ids=frozenset({EOS})
        )
    )


def run(params: SamplingParams, token: int, *, prompt_len: int = 5) -> Sequence:
    sched = scheduler()
    seq = Sequence(0, list(range(prompt_len)), params)
    sched.add(seq)
    run_to_completion(sched, constant_sampler(token))
    return seq


def test_max_tokens_none_runs_until_max_model_len() -> None:
    seq = run(SamplingParams(max_tokens=None), token=3)
    assert seq.num_tokens == 32
    assert seq.finish_reason is FinishReason.LENGTH


def test_eos_and_stop_tokens_end_a_request_only_after_min_tokens() -> None:
    # The (min_tokens + 1)-th token is the first that may stop (as in vLLM: min_tokens
    # tokens are generated before EOS or a stop token can be).
    for token, params in (
        (EOS, SamplingParams(min_tokens=4)),
        (9, SamplingParams(min_tokens=4, stop_token_ids=[9])),
    ):
        seq = run(params, token)
        assert seq.completion_token_ids == [token] * 5
        assert seq.finish_reason is FinishReason.STOP


def test_without_min_tokens_the_first_eos_stops() -> None:
    seq = run(SamplingParams(), token=EOS)
    assert seq.completion_token_ids == [EOS]
    assert seq.finish_reason is FinishReason.STOP


def test_min_tokens_never_extends_past_max_tokens_or_max_model_len() -> None:
    seq = run(SamplingParams(min_tokens=6, max_tokens=6), token=EOS)
    assert seq.num_completion_tokens == 6 and seq.finish_reason is FinishReason.LENGTH
    seq = run(SamplingParams(min_tokens=100, max_tokens=None), token=EOS, prompt_len=20)
    assert seq.num_tokens == 32 and seq.finish_reason is FinishReason.LENGTH


# ------------------------------------------- a stop on the last allowed token (issue 30.3)
# The token that reaches max_tokens (or max_model_len) may also be EOS or a stop token: the
# request then ends with "stop", not "length" (as in vLLM). The rule lives in several places
# (the order of the checks in the scheduler's finish rule, and the decode rows' length
# calendar that must not overwrite a stop), so each path that samples a token is driven here:
# a prefill row, the decode rows, decode rows replayed one by one after an abort, a fork.

STOP = 9


def scripted(prompt_len: int, script: list[int]) -> Callable[[SeqABC[int]], int]:
    """The i-th completion token is ``script[i]``, whatever the sequence."""
    return lambda token_ids: script[len(token_ids) - prompt_len]


def finish(
    params: SamplingParams, script: list[int], *, prompt_len: int = 5, max_model_len: int = 32
) -> Sequence:
    sched = scheduler(max_model_len)
    seq = Sequence(0, list(range(prompt_len)), params)
    sched.add(seq)
    run_to_completion(sched, scripted(prompt_len, script))
    sched.check_integrity()
    return seq


# (max_tokens, prompt length, max_model_len, tokens until the limit): the last token of the
# script is the last one the limit allows.
LIMITS: dict[str, tuple[int | None, int, int, int]] = {
    "max_tokens, decode row": (4, 5, 32, 4),
    "max_tokens, prefill row": (1, 5, 32, 1),
    "max_model_len, decode row": (None, 5, 12, 7),
    "max_model_len, prefill row": (None, 11, 12, 1),
}


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("stop_kind", ["stop_token_ids", "eos"])
def test_a_stop_token_on_the_last_allowed_token_finishes_with_stop(
    limit: str, stop_kind: str
) -> None:
    max_tokens, prompt_len, max_model_len, count = LIMITS[limit]
    token = STOP if stop_kind == "stop_token_ids" else EOS
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[STOP])
    script = [3] * (count - 1) + [token]
    seq = finish(params, script, prompt_len=prompt_len, max_model_len=max_model_len)
    assert seq.completion_token_ids == script
    assert seq.finish_reason is FinishReason.STOP
    # The same request one token short of the stop ends by length, at the same token: the
    # script above is exactly at the limit.
    seq = finish(params, [3] * count + [token], prompt_len=prompt_len, max_model_len=max_model_len)
    assert seq.completion_token_ids == [3] * count
    assert seq.finish_reason is FinishReason.LENGTH


def test_a_stop_token_within_min_tokens_on_the_last_allowed_token_finishes_with_stop() -> None:
    # min_tokens = max_tokens - 1: the last allowed token is the first that may stop.
    seq = finish(SamplingParams(min_tokens=3, max_tokens=4, stop_token_ids=[STOP]), [STOP] * 4)
    assert seq.completion_token_ids == [STOP] * 4
    assert seq.finish_reason is FinishReason.STOP


def test_a_stop_token_on_the_last_allowed_token_in_rows_replayed_after_an_abort() -> None:
    # An abort between schedule() and postprocess() makes the step's decode rows stale: they
    # are recorded one by one (the row path), which must keep the rule too.
    sched = scheduler()
    short = Sequence(0, list(range(5)), SamplingParams(max_tokens=4, stop_token_ids=[STOP]))
    other = Sequence(1, list(range(10, 15)), SamplingParams(max_tokens=20))
    sched.add(short)
    sched.add(other)
    sample = scripted(5, [3, 3, 3, STOP])
    while short.num_completion_tokens < 3:
        assert step(sched, sample) is not None
    plan = sched.schedule()
    assert plan is not None and plan.sampled_seq_ids == [0, 1]
    assert plan.num_decode_rows == 2
    sched.abort(1)
    sched.postprocess(plan, [STOP, 3])
    sched.check_integrity()
    assert short.completion_token_ids == [3, 3, 3, STOP]
    assert short.finish_reason is FinishReason.STOP
    assert other.finish_reason is FinishReason.ABORT


def test_a_stop_token_on_a_forks_only_allowed_token_finishes_with_stop() -> None:
    # n=3, max_tokens=1: every completion's first token (sampled in the prefill step, the
    # forks' first token included) is its last allowed one.
    sched = scheduler()
    params = SamplingParams(max_tokens=1, stop_token_ids=[STOP])
    seqs = [Sequence(i, list(range(5)), params) for i in range(3)]
    sched.add(seqs[0], forks=seqs[1:])
    plan = sched.schedule()
    assert plan is not None and plan.sampled_seq_ids == [0, 1, 2]
    sched.postprocess(plan, [3, STOP, EOS])
    sched.check_integrity()
    assert [s.completion_token_ids for s in seqs] == [[3], [STOP], [EOS]]
    assert [s.finish_reason for s in seqs] == [
        FinishReason.LENGTH,
        FinishReason.STOP,
        FinishReason.STOP,
    ]


# StopRules directly: the questions the loop asks.


def rules() -> StopRules:
    return StopRules(frozenset({EOS}), max_model_len=16)


def test_stop_rules_finish_reason_per_token() -> None:
    seq = Sequence(0, [1, 2], SamplingParams(max_tokens=3, stop_token_ids=[9]))
    seq.token_ids.append(5)
    assert rules().finish_reason(seq, 5) is None
    seq.token_ids.append(EOS)
    assert rules().finish_reason(seq, EOS) is FinishReason.STOP
    assert rules().finish_reason(seq, 9) is FinishReason.STOP
    seq.token_ids.append(5)
    assert rules().finish_reason(seq, 5) is FinishReason.LENGTH  # max_tokens=3


def test_stop_rules_length_limit() -> None:
    assert rules().length_limit(Sequence(0, [1, 2], SamplingParams(max_tokens=3))) == 5
    assert rules().length_limit(Sequence(0, [1, 2], SamplingParams(max_tokens=None))) == 16
    assert rules().length_limit(Sequence(0, [1, 2], SamplingParams(max_tokens=99))) == 16


def test_stop_ids_cover_eos_unless_every_row_ignores_it() -> None:
    plain = Sequence(0, [1], SamplingParams(stop_token_ids=[3]))
    ignoring = Sequence(1, [1], SamplingParams(ignore_eos=True, stop_token_ids=[4]))
    assert rules().stop_ids([ignoring]) == {4}
    assert rules().stop_ids([plain, ignoring]) == {3, 4, EOS}
    assert rules().stop_ids([ignoring], also=frozenset({8})) == {4, 8}


def test_scan_finds_every_row_that_stops_on_a_shared_token() -> None:
    seqs = [Sequence(i, [1], SamplingParams(max_tokens=10)) for i in range(4)]
    tokens = [EOS, 2, EOS, 3]
    for seq, token in zip(seqs, tokens, strict=True):
        seq.token_ids.append(token)
    ignoring = Sequence(9, [1], SamplingParams(ignore_eos=True))
    ignoring.token_ids.append(EOS)
    finishing = rules().scan([*seqs, ignoring], [*tokens, EOS], frozenset({EOS}))
    assert finishing == {seqs[0]: FinishReason.STOP, seqs[2]: FinishReason.STOP}
    assert rules().scan(seqs, tokens, frozenset()) == {}
