"""RequestLimits on its own (pure Python): defaults, the largest accepted size next to the
smallest refused one for every limit, and the whole message of each refusal."""

from __future__ import annotations

from typing import Any

import pytest

from pagedinfer.domain import SamplingParams
from pagedinfer.domain.limits import RequestLimits
from pagedinfer.errors import ConfigurationError, InvalidRequestError

VOCAB = 50
LIMITS = RequestLimits(max_n=3, max_logprobs=4, max_stop=2, max_stop_str_len=5)


def test_the_defaults() -> None:
    limits = RequestLimits()
    assert (limits.max_n, limits.max_logprobs, limits.max_stop, limits.max_stop_str_len) == (
        128,
        20,
        64,
        1024,
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_n": 0}, "max_n=0 is invalid: expected an integer >= 1."),
        ({"max_stop": 0}, "max_stop=0 is invalid: expected an integer >= 1."),
        ({"max_stop_str_len": 0}, "max_stop_str_len=0 is invalid: expected an integer >= 1."),
        ({"max_n": True}, "max_n=True is invalid: expected an integer >= 1."),
        ({"max_stop": 2.0}, "max_stop=2.0 is invalid: expected an integer >= 1."),
        (
            {"max_logprobs": -2},
            "max_logprobs=-2 is invalid: expected an integer >= 0, or -1 for the whole vocabulary.",
        ),
        (
            {"max_logprobs": False},
            "max_logprobs=False is invalid: expected an integer >= 0, or -1 for the whole "
            "vocabulary.",
        ),
    ],
)
def test_bad_limits_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        RequestLimits(**fields)
    assert str(info.value) == message


def test_the_smallest_limits_are_accepted() -> None:
    limits = RequestLimits(max_n=1, max_logprobs=-1, max_stop=1, max_stop_str_len=1)
    assert limits.max_logprobs_for(VOCAB) == VOCAB
    assert RequestLimits(max_logprobs=0).max_logprobs_for(VOCAB) == 0
    assert LIMITS.max_logprobs_for(VOCAB) == 4


@pytest.mark.parametrize(
    ("accepted", "refused", "message"),
    [
        (
            {"n": 3},
            {"n": 4},
            "SamplingParams.n=4 exceeds max_n=3: ask for fewer completions, or raise the limit "
            "(Engine(max_n=...), command line --max-n).",
        ),
        (
            {"logprobs": 4},
            {"logprobs": 5},
            "SamplingParams.logprobs=5 exceeds max_logprobs=4: ask for fewer, or raise the "
            "limit (Engine(max_logprobs=...), command line --max-logprobs).",
        ),
        (
            {"prompt_logprobs": 4},
            {"prompt_logprobs": 5},
            "SamplingParams.prompt_logprobs=5 exceeds max_logprobs=4: ask for fewer, or raise "
            "the limit (Engine(max_logprobs=...), command line --max-logprobs).",
        ),
        (
            {"stop": ["a", "b"]},
            {"stop": ["a", "b", "c"]},
            "SamplingParams.stop=<3 strings> exceeds max_stop=2: raise the limit "
            "(Engine(max_stop=...), command line --max-stop).",
        ),
        (
            {"stop": ["abcde"]},
            {"stop": ["a", "abcdef"]},
            "SamplingParams.stop=<a string of 6 characters> exceeds max_stop_str_len=5: use "
            "shorter stop strings, or raise the limit (Engine(max_stop_str_len=...), command "
            "line --max-stop-str-len).",
        ),
        (
            {"stop_token_ids": list(range(VOCAB))},
            {"stop_token_ids": list(range(VOCAB + 1))},
            "SamplingParams.stop_token_ids has 51 entries but the model's vocabulary has 50 "
            "tokens: name each token id at most once.",
        ),
        (
            {"allowed_token_ids": list(range(VOCAB))},
            {"allowed_token_ids": list(range(VOCAB + 1))},
            "SamplingParams.allowed_token_ids has 51 entries but the model's vocabulary has 50 "
            "tokens: name each token id at most once.",
        ),
        (
            {"logit_bias": dict.fromkeys(range(VOCAB), 1.0)},
            {"logit_bias": dict.fromkeys(range(VOCAB + 1), 1.0)},
            "SamplingParams.logit_bias has 51 entries but the model's vocabulary has 50 "
            "tokens: name each token id at most once.",
        ),
    ],
    ids=["n", "logprobs", "prompt_logprobs", "stop", "stop_len", "stop_ids", "allowed", "bias"],
)
def test_each_limit_accepts_its_bound_and_refuses_one_more(
    accepted: dict[str, Any], refused: dict[str, Any], message: str
) -> None:
    LIMITS.check(SamplingParams(**accepted), vocab_size=VOCAB)
    with pytest.raises(InvalidRequestError) as info:
        LIMITS.check(SamplingParams(**refused), vocab_size=VOCAB)
    assert str(info.value) == message


def test_max_logprobs_minus_one_allows_the_whole_vocabulary() -> None:
    limits = RequestLimits(max_logprobs=-1)
    limits.check(SamplingParams(logprobs=VOCAB, prompt_logprobs=VOCAB), vocab_size=VOCAB)
    with pytest.raises(InvalidRequestError, match=r"logprobs=51 exceeds max_logprobs=50"):
        limits.check(SamplingParams(logprobs=VOCAB + 1), vocab_size=VOCAB)
