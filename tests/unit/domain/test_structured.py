"""StructuredOutputsParams: the value's shape checks, its hashable forms, SamplingParams' field.

Whether a schema, regex or grammar compiles is the engine's check (tests/unit/engine/
test_structured_outputs.py); here only what the pure-Python value decides.
"""

from __future__ import annotations

import json

import pytest

import pagedinfer
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.structured import GuidedDecodingParams, StructuredOutputsParams
from pagedinfer.errors import InvalidRequestError, InvalidStructuredOutputError

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def test_exported_from_the_package_root() -> None:
    assert pagedinfer.StructuredOutputsParams is StructuredOutputsParams
    assert pagedinfer.GuidedDecodingParams is StructuredOutputsParams
    assert issubclass(InvalidStructuredOutputError, InvalidRequestError)
    assert issubclass(InvalidStructuredOutputError, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        ({"json": SCHEMA}, "json"),
        ({"regex": r"\d+"}, "regex"),
        ({"choice": ["yes", "no"]}, "choice"),
        ({"grammar": 'start: "a"+'}, "grammar"),
        ({"json_object": True}, "json_object"),
        ({"json_object": False, "regex": "a"}, "regex"),
    ],
)
def test_kind_is_the_one_constraint_set(kwargs: dict[str, object], kind: str) -> None:
    assert StructuredOutputsParams(**kwargs).kind == kind  # type: ignore[arg-type]


def test_a_schema_is_stored_as_json_text_in_its_key_order() -> None:
    from_dict = StructuredOutputsParams(json=SCHEMA)
    from_text = StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2))
    assert from_dict == from_text and hash(from_dict) == hash(from_text)
    assert isinstance(from_dict.json, str)
    assert list(json.loads(from_dict.json)["properties"]) == ["b", "a"]  # order kept
    assert from_dict.schema == SCHEMA
    assert from_dict.schema is not from_dict.schema  # a fresh dict: the value stays frozen


def test_a_pydantic_model_class_gives_its_schema() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):  # type: ignore[misc, name-defined]
        x: int
        y: int

    params = StructuredOutputsParams(json=Point)
    assert params.schema == Point.model_json_schema()


def test_choice_is_stored_as_a_tuple_and_hashes() -> None:
    params = StructuredOutputsParams(choice=["a", "b"])
    assert params.choice == ("a", "b")
    assert hash(params) == hash(StructuredOutputsParams(choice=("a", "b")))
    assert params.cache_key == StructuredOutputsParams(choice=["a", "b"]).cache_key


def test_disable_fallback_does_not_change_the_cache_key() -> None:
    plain = StructuredOutputsParams(regex="a+")
    assert plain.cache_key == StructuredOutputsParams(regex="a+", disable_fallback=True).cache_key
    assert (
        StructuredOutputsParams(json=SCHEMA).cache_key
        != StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).cache_key
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one constraint .* got none"),
        ({"json": SCHEMA, "regex": "a"}, "got json, regex"),
        ({"json_object": False}, "got none"),
        ({"json": "{not json"}, "json is not valid JSON"),
        ({"json": "[1, 2]"}, "a JSON schema object"),
        ({"json": 3}, "a JSON schema: a dict"),
        ({"json": {"x": float("nan")}}, "not JSON"),
        ({"regex": ""}, "regex='' is invalid: expected a non-empty string"),
        ({"choice": "yes"}, "choice='yes' is invalid"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", 1]}, "non-empty list of non-empty strings"),
        ({"grammar": 5}, "grammar=5 is invalid"),
        ({"json_object": "yes"}, "json_object='yes'"),
        ({"regex": "a", "disable_any_whitespace": True}, "json and json_object only, not to regex"),
        ({"choice": ["a"], "whitespace_pattern": " "}, "whitespace_pattern shapes JSON"),
        (
            {"json": SCHEMA, "whitespace_pattern": " ", "disable_any_whitespace": True},
            "contradict",
        ),
        ({"json": SCHEMA, "disable_any_whitespace": 1}, "disable_any_whitespace=1"),
        ({"structural_tag": "{}"}, "structural_tag='{}' is invalid"),
        (
            {
                "structural_tag": json.dumps(
                    {
                        "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
                        "triggers": ["<g"],
                    }
                )
            },
            "every begin starts with one of the triggers",
        ),
    ],
)
def test_malformed_constraints_name_the_problem(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidStructuredOutputError, match=message):
        StructuredOutputsParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_carry_the_constraint_and_the_old_name() -> None:
    constraint = StructuredOutputsParams(regex="a+")
    params = SamplingParams(structured_outputs=constraint)
    assert params.structured_outputs is constraint
    old = SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+"))
    assert old.structured_outputs == constraint and old.guided_decoding is None
    assert old == params and hash(old) == hash(params)
    # The same constraint under both names is fine; two different ones are not.
    assert SamplingParams(structured_outputs=constraint, guided_decoding=constraint) == params
    with pytest.raises(ValueError, match="guided_decoding is vLLM's older name"):
        SamplingParams(
            structured_outputs=constraint,
            guided_decoding=StructuredOutputsParams(regex="b"),
        )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ignore_eos": True}, "ignore_eos"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ],
)
def test_sampling_params_refuse_what_could_leave_no_token(
    kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}=.* with structured_outputs"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"), **kwargs)  # type: ignore[arg-type]


def test_sampling_params_refuse_a_dict_for_the_constraint() -> None:
    with pytest.raises(ValueError, match=r"structured_outputs=.* StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
