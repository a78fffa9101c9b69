"""When the scheduler ends a request: max_tokens=None, min_tokens, EOS and stop tokens."""

from __future__ import annotations

from pagedinfer.domain import FinishReason, SamplingParams, Scheduler, SchedulerConfig, Sequence

from .driver import constant_sampler, run_to_completion

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
