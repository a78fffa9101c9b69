"""SamplingParams validation, pinned: the whole message of every refusal (field, value and
what is allowed) and the accepted values at each bound. Found by mutation testing
(docs/testing.md): the field tests elsewhere match a fragment of the message and test
values away from the bounds."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pagedinfer.domain import SamplingParams
from pagedinfer.domain.sampling import FLOAT32_MAX, MAX_SEED, LogitBias
from pagedinfer.domain.structured import StructuredOutputsParams
from pagedinfer.errors import InvalidSamplingParamsError

REPETITION_RANGE = (
    "a number in [1e-06, 1e+06] (1 switches it off; > 1 discourages repetition; outside the "
    "range the sampler's float32 arithmetic overflows)"
)

# (fields, the field named, the value as shown, what is allowed): the message is
# "SamplingParams.{field}={shown} is invalid: expected {allowed}."
REFUSED = [
    pytest.param(
        {"temperature": -0.001},
        "temperature",
        "-0.001",
        "a number in [0, 3.402823e+38] (finite in float32; below 1e-05 means greedy)",
        id="temperature",
    ),
    pytest.param(
        {"temperature": math.inf},
        "temperature",
        "inf",
        "a number in [0, 3.402823e+38] (finite in float32; below 1e-05 means greedy)",
        id="temperature inf",
    ),
    pytest.param(
        {"temperature": 3.5e38},
        "temperature",
        "3.5e+38",
        "a number in [0, 3.402823e+38] (finite in float32; below 1e-05 means greedy)",
        id="temperature too big",
    ),
    pytest.param(
        {"temperature": "1"},
        "temperature",
        "'1'",
        "a number in [0, 3.402823e+38] (finite in float32; below 1e-05 means greedy)",
        id="temperature str",
    ),
    pytest.param(
        {"top_k": -2},
        "top_k",
        "-2",
        "an integer >= 1, or 0 or -1 to switch top-k off",
        id="top_k",
    ),
    pytest.param(
        {"top_k": 2.0},
        "top_k",
        "2.0",
        "an integer >= 1, or 0 or -1 to switch top-k off",
        id="top_k float",
    ),
    pytest.param(
        {"top_p": 0.0},
        "top_p",
        "0.0",
        "a number in (0, 1] (1 switches top-p off)",
        id="top_p 0",
    ),
    pytest.param(
        {"top_p": 1.0001},
        "top_p",
        "1.0001",
        "a number in (0, 1] (1 switches top-p off)",
        id="top_p >1",
    ),
    pytest.param(
        {"min_p": -0.01},
        "min_p",
        "-0.01",
        "a number in [0, 1] (0 switches min-p off)",
        id="min_p <0",
    ),
    pytest.param(
        {"min_p": 1.01},
        "min_p",
        "1.01",
        "a number in [0, 1] (0 switches min-p off)",
        id="min_p >1",
    ),
    pytest.param(
        {"max_tokens": 0},
        "max_tokens",
        "0",
        "an integer >= 1, or None for max_model_len",
        id="max_tokens 0",
    ),
    pytest.param(
        {"max_tokens": True},
        "max_tokens",
        "True",
        "an integer >= 1, or None for max_model_len",
        id="max_tokens bool",
    ),
    pytest.param(
        {"min_tokens": -1},
        "min_tokens",
        "-1",
        "an integer >= 0",
        id="min_tokens -1",
    ),
    pytest.param(
        {"min_tokens": 5, "max_tokens": 4},
        "min_tokens",
        "5",
        "an integer in [0, max_tokens=4]",
        id="min_tokens > max",
    ),
    pytest.param(
        {"n": 0},
        "n",
        "0",
        "an integer >= 1",
        id="n 0",
    ),
    pytest.param(
        {"presence_penalty": -2.01},
        "presence_penalty",
        "-2.01",
        "a number in [-2.0, 2.0] (0 switches it off)",
        id="presence low",
    ),
    pytest.param(
        {"frequency_penalty": 2.01},
        "frequency_penalty",
        "2.01",
        "a number in [-2.0, 2.0] (0 switches it off)",
        id="frequency high",
    ),
    pytest.param(
        {"repetition_penalty": 9e-07},
        "repetition_penalty",
        "9e-07",
        REPETITION_RANGE,
        id="repetition low",
    ),
    pytest.param(
        {"repetition_penalty": 1100000.0},
        "repetition_penalty",
        "1100000.0",
        REPETITION_RANGE,
        id="repetition high",
    ),
    pytest.param(
        {"logprobs": -1},
        "logprobs",
        "-1",
        "None or an integer >= 0 (how many top tokens to return)",
        id="logprobs -1",
    ),
    pytest.param(
        {"prompt_logprobs": 1.0},
        "prompt_logprobs",
        "1.0",
        "None or an integer >= 0 (how many top tokens to return)",
        id="prompt_logprobs float",
    ),
    pytest.param(
        {"ignore_eos": 1},
        "ignore_eos",
        "1",
        "True or False",
        id="ignore_eos int",
    ),
    pytest.param(
        {"stop_token_ids": [3, -1]},
        "stop_token_ids",
        "(3, -1)",
        "a sequence of integers >= 0",
        id="stop_token_ids neg",
    ),
    pytest.param(
        {"stop": ["a", ""]},
        "stop",
        "('a', '')",
        "a string or a sequence of non-empty strings",
        id="stop empty string",
    ),
    pytest.param(
        {"seed": -1},
        "seed",
        "-1",
        "None or an integer in [0, 9223372036854775807] (2**63 - 1)",
        id="seed neg",
    ),
    pytest.param(
        {"seed": 9223372036854775808},
        "seed",
        "9223372036854775808",
        "None or an integer in [0, 9223372036854775807] (2**63 - 1)",
        id="seed big",
    ),
    pytest.param(
        {"allowed_token_ids": []},
        "allowed_token_ids",
        "()",
        "None or a non-empty sequence of token ids >= 0",
        id="allowed empty",
    ),
    pytest.param(
        {"allowed_token_ids": [1, -2]},
        "allowed_token_ids",
        "(1, -2)",
        "None or a non-empty sequence of token ids >= 0",
        id="allowed neg",
    ),
    pytest.param(
        {"logit_bias": {-1: 1.0}},
        "logit_bias",
        "{-1: 1.0}",
        "token ids (keys) >= 0",
        id="bias key",
    ),
    pytest.param(
        {"logit_bias": {3: 15000000000.0}},
        "logit_bias",
        "{3: 15000000000.0}",
        "biases in [-1e+10, 1e+10] (token 3 has 15000000000.0; larger biases overflow the "
        "sampler's float32 logits)",
        id="bias value",
    ),
    pytest.param(
        {"logit_bias": [1, 2]},
        "logit_bias",
        "[1, 2]",
        "None or a dict {token_id: bias}",
        id="bias type",
    ),
    pytest.param(
        {"stop_token_ids": 5},
        "stop_token_ids",
        "5",
        "a sequence",
        id="stop ids type",
    ),
]


@pytest.mark.parametrize(("fields", "field", "shown", "allowed"), REFUSED)
def test_a_refused_value_and_its_whole_message(
    fields: dict[str, Any], field: str, shown: str, allowed: str
) -> None:
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**fields)
    assert str(info.value) == f"SamplingParams.{field}={shown} is invalid: expected {allowed}."


def test_a_long_value_is_shown_cut_with_its_length() -> None:
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(stop_token_ids=list(range(-1, 100)))
    shown = repr(tuple(range(-1, 100)))
    assert str(info.value) == (
        f"SamplingParams.stop_token_ids={shown[:160]}... ({len(shown)} characters) is invalid: "
        "expected a sequence of integers >= 0."
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.0},
        {"temperature": FLOAT32_MAX},
        {"top_k": 0},
        {"top_k": 1},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"max_tokens": 1},
        {"max_tokens": None},
        {"min_tokens": 0},
        {"min_tokens": 4, "max_tokens": 4},
        {"min_tokens": 9, "max_tokens": None},
        {"n": 1},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"presence_penalty": 2, "frequency_penalty": -2},
        {"repetition_penalty": 1e-6},
        {"repetition_penalty": 1e6},
        {"logprobs": 0, "prompt_logprobs": 0},
        {"stop_token_ids": [0]},
        {"seed": 0},
        {"seed": MAX_SEED},
        {"allowed_token_ids": [0]},
        {"logit_bias": {0: -1e10, 1: 1e10}},
    ],
)
def test_the_bounds_are_accepted(fields: dict[str, Any]) -> None:
    params = SamplingParams(**fields)
    for name, value in fields.items():
        if isinstance(value, list):
            assert getattr(params, name) == tuple(value)
        elif isinstance(value, dict):
            assert dict(getattr(params, name)) == value
        else:
            assert getattr(params, name) == value


def test_minus_one_switches_top_k_off_as_zero() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


def test_one_stop_string_is_a_sequence_of_one() -> None:
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=["ab", "c"]).stop == ("ab", "c")


@pytest.mark.parametrize(("length", "cut"), [(200, False), (201, True)])
def test_a_value_is_shown_whole_up_to_200_characters(length: int, cut: bool) -> None:
    stop = ("", "x" * (length - 8))  # repr: ('', 'xx...x')
    shown = repr(stop)
    assert len(shown) == length
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(stop=stop)
    if cut:
        shown = f"{shown[:160]}... ({length} characters)"
    assert str(info.value) == (
        f"SamplingParams.stop={shown} is invalid: expected a string or a sequence of non-empty "
        "strings."
    )


@pytest.mark.parametrize("entries", [8, 9])
def test_a_logit_bias_is_shown_whole_up_to_8_entries(entries: int) -> None:
    bias = {token: 0.5 for token in range(entries - 1)} | {entries: 1e11}
    shown = repr(bias) if entries <= 8 else f"'<{entries} entries>'"
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(logit_bias=bias)
    assert str(info.value) == (
        f"SamplingParams.logit_bias={shown} is invalid: expected biases in [-1e+10, 1e+10] "
        f"(token {entries} has 100000000000.0; larger biases overflow the sampler's float32 "
        "logits)."
    )


def test_a_logit_bias_shows_and_hashes_as_its_entries() -> None:
    bias = LogitBias({3: 0.5, 1: -2.0})
    assert repr(bias) == "{3: 0.5, 1: -2.0}"
    assert repr(SamplingParams(logit_bias={3: 0.5})).count("logit_bias={3: 0.5}") == 1
    # Equal biases hash alike; these different ones (hashes of ints and floats are fixed in
    # Python) hash apart, so params that differ only in their bias spread in a dict.
    assert hash(bias) == hash(LogitBias({1: -2.0, 3: 0.5}))
    assert len({hash(LogitBias({token: 1.0})) for token in range(8)}) == 8


CONFLICT = "is invalid: expected its default with structured_outputs"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"structured_outputs": {"regex": "a"}},
            "SamplingParams.structured_outputs={'regex': 'a'} is invalid: expected None or a "
            "StructuredOutputsParams(json=..., regex=..., choice=[...], grammar=..., "
            "json_object=True).",
        ),
        (
            {"ignore_eos": True},
            f"SamplingParams.ignore_eos=True {CONFLICT} (the output ends where the grammar "
            "ends): drop ignore_eos or structured_outputs.",
        ),
        (
            {"min_tokens": 1},
            f"SamplingParams.min_tokens=1 {CONFLICT} (EOS held back where the grammar allows "
            "only EOS would leave no token): drop min_tokens or structured_outputs.",
        ),
        (
            {"allowed_token_ids": [1]},
            f"SamplingParams.allowed_token_ids=(1,) {CONFLICT} (the grammar decides which "
            "tokens are allowed): drop allowed_token_ids or structured_outputs.",
        ),
    ],
)
def test_what_structured_outputs_cannot_be_combined_with(
    fields: dict[str, Any], message: str
) -> None:
    fields = {"structured_outputs": StructuredOutputsParams(regex="a")} | fields
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**fields)
    assert str(info.value) == message


def test_two_different_constraints_under_both_names_are_refused() -> None:
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a"),
            guided_decoding=StructuredOutputsParams(regex="b"),
        )
    assert str(info.value) == (
        "SamplingParams.guided_decoding=StructuredOutputsParams(regex='b') is invalid: expected "
        "None when structured_outputs is set (guided_decoding is vLLM's older name of "
        "structured_outputs: set only structured_outputs)."
    )


def test_none_for_the_stop_fields_is_vllms_default_stored_as_empty() -> None:
    params = SamplingParams(stop_token_ids=None, stop=None)  # type: ignore[arg-type]
    assert params.stop_token_ids == () and params.stop == ()
    assert params == SamplingParams()
