"""SamplingParams: defaults, validation naming the field, normalisation, immutability."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pagedinfer.domain import SamplingParams
from pagedinfer.errors import InvalidSamplingParamsError, PagedInferError


def test_defaults_match_the_spec() -> None:
    params = SamplingParams()
    assert params.temperature == 1.0
    assert params.top_k == 0
    assert params.top_p == 1.0
    assert params.max_tokens == 64
    assert params.ignore_eos is False
    assert params.stop_token_ids == ()
    assert params.stop == ()
    assert params.seed is None
    assert not params.is_greedy


def test_temperature_zero_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-6).is_greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "1.0"),
        ("temperature", True),
        ("temperature", None),
        ("top_k", -1),
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
        {"seed": -7},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]


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
