"""SamplingParams: defaults, validation naming the field, normalisation, immutability."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pagedinfer.domain import SamplingParams
from pagedinfer.domain.sampling import (
    FLOAT32_MAX,
    GREEDY_TEMPERATURE_EPSILON,
    LOGIT_BIAS_MAX,
    MAX_SEED,
    REPETITION_PENALTY_RANGE,
)
from pagedinfer.errors import InvalidSamplingParamsError, PagedInferError


def test_defaults_match_the_spec() -> None:
    params = SamplingParams()
    assert params.temperature == 1.0
    assert params.top_k == 0
    assert params.top_p == 1.0
    assert params.max_tokens == 16  # vLLM's default (SPEC said 64 before issue 22)
    assert params.ignore_eos is False
    assert params.stop_token_ids == ()
    assert params.stop == ()
    assert params.seed is None
    assert not params.is_greedy
    # vLLM's fields and defaults
    assert params.n == 1
    assert params.presence_penalty == 0.0
    assert params.frequency_penalty == 0.0
    assert params.repetition_penalty == 1.0
    assert params.min_p == 0.0
    assert params.min_tokens == 0
    assert params.logprobs is None
    assert params.prompt_logprobs is None
    assert params.logit_bias is None
    assert params.allowed_token_ids is None
    assert params.include_stop_str_in_output is False
    assert params.skip_special_tokens is True
    assert not params.uses_penalties
    assert not params.uses_logits_processing


def test_temperature_below_the_epsilon_is_greedy() -> None:
    assert GREEDY_TEMPERATURE_EPSILON == 1e-5
    for temperature in (0, 0.0, 1e-40, 1e-50, 5e-324, 9.99e-6):
        assert SamplingParams(temperature=temperature).is_greedy, temperature
    for temperature in (1e-5, 1e-4, 0.5, 1e30):
        assert not SamplingParams(temperature=temperature).is_greedy, temperature


def test_top_k_minus_one_is_off_and_stored_as_zero() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


def test_max_tokens_none_means_until_max_model_len() -> None:
    params = SamplingParams(max_tokens=None, min_tokens=10_000)
    assert params.max_tokens is None
    assert params.min_tokens == 10_000


def test_seed_range_is_0_to_2_pow_63_minus_1() -> None:
    assert MAX_SEED == 2**63 - 1
    SamplingParams(seed=0)
    SamplingParams(seed=MAX_SEED)
    for seed in (-1, MAX_SEED + 1, 2**64):
        with pytest.raises(InvalidSamplingParamsError, match=r"seed=.*\[0, 9223372036854775807\]"):
            SamplingParams(seed=seed)


def test_feature_flags() -> None:
    assert SamplingParams(presence_penalty=0.5).uses_penalties
    assert SamplingParams(frequency_penalty=-0.5).uses_penalties
    assert SamplingParams(repetition_penalty=1.2).uses_penalties
    for kwargs in (
        {"min_p": 0.1},
        {"min_tokens": 3},
        {"logit_bias": {5: 1.0}},
        {"allowed_token_ids": [1, 2]},
        {"repetition_penalty": 0.9},
    ):
        assert SamplingParams(**kwargs).uses_logits_processing, kwargs  # type: ignore[arg-type]
    for kwargs in ({"logprobs": 5}, {"n": 3}, {"top_k": 5, "top_p": 0.5}, {"logit_bias": {}}):
        assert not SamplingParams(**kwargs).uses_logits_processing, kwargs  # type: ignore[arg-type]


def test_max_token_id_covers_every_field_that_names_tokens() -> None:
    assert SamplingParams().max_token_id() is None
    params = SamplingParams(stop_token_ids=[3], allowed_token_ids=[9, 2], logit_bias={40: 1.0})
    assert params.max_token_id() == 40


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "1.0"),
        ("temperature", True),
        ("temperature", None),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_p", "0.9"),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.0),
        ("max_tokens", False),
        ("ignore_eos", 1),
        ("ignore_eos", "yes"),
        ("stop_token_ids", [1, -2]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 7),
        ("stop_token_ids", "12"),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop", ""),
        ("seed", 1.5),
        ("seed", "42"),
        ("seed", True),
        ("seed", -7),
        ("seed", 2**63),
        ("n", 0),
        ("n", -1),
        ("n", 1.0),
        ("n", None),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("presence_penalty", math.nan),
        ("presence_penalty", "0"),
        ("frequency_penalty", 3),
        ("frequency_penalty", -math.inf),
        ("frequency_penalty", None),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("repetition_penalty", math.nan),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("min_p", math.nan),
        ("min_p", None),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above the default max_tokens=16
        ("min_tokens", 1.0),
        ("min_tokens", None),
        ("logprobs", -1),
        ("logprobs", 2.0),
        ("logprobs", True),
        ("prompt_logprobs", -3),
        ("prompt_logprobs", "5"),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", {5: math.inf}),
        ("logit_bias", {5: math.nan}),
        ("logit_bias", {5: "big"}),
        ("logit_bias", [(5, 1.0)]),
        ("logit_bias", 3),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [1, -1]),
        ("allowed_token_ids", [1.0]),
        ("allowed_token_ids", 5),
        ("allowed_token_ids", "12"),
        ("include_stop_str_in_output", 1),
        ("include_stop_str_in_output", None),
        ("skip_special_tokens", 0),
        ("skip_special_tokens", "no"),
        ("max_tokens", math.inf),
        # Finite in float64 but not in float32, or overflowing the sampler's float32 logits
        # (issue 21, item 4: these became inf / NaN on the device, which then sampled token 0
        # whatever allowed_token_ids and min_tokens said).
        ("temperature", 1e39),
        pytest.param("temperature", 10**400, id="temperature-10**400"),  # too large for a float
        ("logit_bias", {5: 1e39}),
        ("logit_bias", {5: -1e39}),
        ("logit_bias", {5: 1.01e10}),
        pytest.param("logit_bias", {5: -(10**400)}, id="logit_bias--10**400"),
        ("repetition_penalty", 1e-46),
        ("repetition_penalty", 9.9e-7),
        ("repetition_penalty", 1.01e6),
        pytest.param("repetition_penalty", 10**400, id="repetition_penalty-10**400"),
    ],
)
def test_bad_value_raises_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidSamplingParamsError) as excinfo:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    message = str(excinfo.value)
    assert f"SamplingParams.{field}=" in message
    assert "expected" in message  # the allowed range is spelled out


def test_validation_error_is_a_value_error_and_a_pagedinfer_error() -> None:
    with pytest.raises(ValueError):
        SamplingParams(top_p=2.0)
    with pytest.raises(PagedInferError):
        SamplingParams(top_p=2.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 2},
        {"top_k": 1},
        {"top_p": 1e-9},
        {"top_p": 1},
        {"max_tokens": 1},
        {"ignore_eos": True},
        {"stop_token_ids": [0, 151643]},
        {"stop": ["\n\n", "END"]},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"n": 8},
        {"presence_penalty": -2.0},
        {"presence_penalty": 2},
        {"frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"repetition_penalty": 5},
        {"min_p": 0},
        {"min_p": 1},
        {"min_tokens": 16},
        {"max_tokens": 5, "min_tokens": 5},
        {"logprobs": 0},
        {"logprobs": 20},
        {"prompt_logprobs": 0},
        {"logit_bias": {0: -100.0, 7: 3}},
        {"allowed_token_ids": [0]},
        {"allowed_token_ids": range(3)},
        {"include_stop_str_in_output": True},
        {"skip_special_tokens": False},
        {"max_tokens": None},
        # The float32 bounds themselves (module docstring of domain/sampling.py).
        {"temperature": FLOAT32_MAX},
        {"temperature": 1e30},
        {"logit_bias": {1: LOGIT_BIAS_MAX, 2: -LOGIT_BIAS_MAX, 3: -(10**10)}},
        {"repetition_penalty": REPETITION_PENALTY_RANGE[0]},
        {"repetition_penalty": REPETITION_PENALTY_RANGE[1]},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_logit_bias_is_a_read_only_hashable_mapping() -> None:
    a = SamplingParams(logit_bias={3: 1.5, 9: -2.0})
    b = SamplingParams(logit_bias={9: -2.0, 3: 1.5})
    assert a == b and hash(a) == hash(b)
    assert a.logit_bias is not None
    assert a.logit_bias[3] == 1.5 and dict(a.logit_bias) == {3: 1.5, 9: -2.0}
    with pytest.raises(TypeError):
        a.logit_bias[3] = 0.0  # type: ignore[index]
    assert SamplingParams(logit_bias={3: 1.0}) != SamplingParams(logit_bias={3: 2.0})
    assert dataclasses.replace(a, n=2).logit_bias == a.logit_bias


def test_allowed_token_ids_are_stored_as_a_tuple() -> None:
    params = SamplingParams(allowed_token_ids=[4, 2])
    assert params.allowed_token_ids == (4, 2)
    assert hash(params) == hash(SamplingParams(allowed_token_ids=(4, 2)))


def test_lists_are_normalised_to_tuples() -> None:
    params = SamplingParams(stop_token_ids=[3, 4], stop=["a", "b"])  # type: ignore[arg-type]
    assert params.stop_token_ids == (3, 4)
    assert params.stop == ("a", "b")
    assert isinstance(params.stop_token_ids, tuple)
    assert isinstance(params.stop, tuple)


def test_a_generator_is_normalised_too() -> None:
    params = SamplingParams(stop_token_ids=(i for i in (5, 6)))  # type: ignore[arg-type]
    assert params.stop_token_ids == (5, 6)


def test_single_stop_string_becomes_a_one_tuple() -> None:
    assert SamplingParams(stop="###").stop == ("###",)  # type: ignore[arg-type]


def test_normalised_params_are_hashable_and_compare_by_value() -> None:
    a = SamplingParams(stop_token_ids=[1, 2], stop=["x"])  # type: ignore[arg-type]
    b = SamplingParams(stop_token_ids=(1, 2), stop=("x",))
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1


def test_params_are_frozen() -> None:
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 1  # type: ignore[misc]


def test_replace_revalidates() -> None:
    params = SamplingParams(max_tokens=8)
    assert dataclasses.replace(params, max_tokens=9).max_tokens == 9
    with pytest.raises(InvalidSamplingParamsError, match="max_tokens"):
        dataclasses.replace(params, max_tokens=0)


def test_the_float32_bounds() -> None:
    assert FLOAT32_MAX == 3.4028234663852886e38  # torch.finfo(torch.float32).max
    assert (LOGIT_BIAS_MAX, REPETITION_PENALTY_RANGE) == (1e10, (1e-6, 1e6))
    # The largest magnitude the sampler can reach stays far from float32's overflow.
    low, high = REPETITION_PENALTY_RANGE
    assert (1e10 + LOGIT_BIAS_MAX) * max(high, 1 / low) / GREEDY_TEMPERATURE_EPSILON < 1e30


def test_a_long_bad_list_gives_a_short_message() -> None:
    with pytest.raises(InvalidSamplingParamsError) as excinfo:
        SamplingParams(stop_token_ids=[1] * 100_000 + [-1])
    assert len(str(excinfo.value)) < 400
