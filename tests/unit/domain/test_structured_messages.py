"""StructuredOutputsParams' checks pinned: every refusal of a structural tag with its whole
message, the stored JSON text of a schema, the messages of schemas that are not JSON, and the
repr. Found by mutation testing (docs/testing.md): test_structured.py matches fragments."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagedinfer.domain.structured import StructuredOutputsParams
from pagedinfer.errors import InvalidStructuredOutputError

EXPECTED_TAG = (
    'a JSON object {"structures": [{"begin": str, "schema": {...}, "end": str}, ...], '
    '"triggers": [str, ...]} in which every begin starts with one of the triggers'
)
TOOL = {"begin": "<f=get>", "schema": {"type": "object"}, "end": "</f>"}


@pytest.mark.parametrize(
    "tag",
    [
        [TOOL],
        {"triggers": ["<f"]},
        {"structures": TOOL, "triggers": ["<f"]},
        {"structures": [], "triggers": ["<f"]},
        {"structures": [TOOL]},
        {"structures": [TOOL], "triggers": "<f"},
        {"structures": [TOOL], "triggers": []},
        {"structures": [TOOL], "triggers": ["<f", 3]},
        {"structures": [TOOL], "triggers": ["<f", ""]},
        {"structures": [TOOL, "<f=x>"], "triggers": ["<f"]},
        {"structures": [TOOL, {**TOOL, "begin": 1}], "triggers": ["<f"]},
        {"structures": [TOOL, {"begin": "<f", "schema": {}}], "triggers": ["<f"]},
        {"structures": [TOOL, {**TOOL, "end": None}], "triggers": ["<f"]},
        {"structures": [TOOL, {**TOOL, "schema": "object"}], "triggers": ["<f"]},
        {"structures": [TOOL, {**TOOL, "begin": "<g>"}], "triggers": ["<f"]},
    ],
)
def test_a_malformed_structural_tag_is_refused_with_the_whole_message(tag: object) -> None:
    text = json.dumps(tag)
    with pytest.raises(InvalidStructuredOutputError) as info:
        StructuredOutputsParams(structural_tag=text)
    shown = repr(text) if len(repr(text)) <= 200 else f"{repr(text)[:160]}..."
    assert str(info.value).startswith(f"StructuredOutputsParams.structural_tag={shown}")
    assert str(info.value).endswith(f" is invalid: expected {EXPECTED_TAG}.")


def test_a_structural_tag_whose_begins_start_with_any_trigger_is_accepted() -> None:
    other = {**TOOL, "begin": "<tool>"}
    text = json.dumps({"structures": [TOOL, other], "triggers": ["<f", "<tool"]})
    assert StructuredOutputsParams(structural_tag=text).kind == "structural_tag"


def test_a_structural_tag_that_is_not_json() -> None:
    with pytest.raises(InvalidStructuredOutputError) as info:
        StructuredOutputsParams(structural_tag="{")
    assert str(info.value) == (
        "StructuredOutputsParams.structural_tag is not valid JSON (Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1))."
    )


@pytest.mark.parametrize(
    "schema",
    [
        {"title": "é", "type": "object", "properties": {"b": {}, "a": {}}},
        '{ "title" : "é",  "type": "object", "properties": {"b": {}, "a": {}} }',
    ],
)
def test_a_schema_is_stored_as_compact_json_text_keeping_its_characters(schema: Any) -> None:
    stored = StructuredOutputsParams(json=schema).json
    assert stored == '{"title":"é","type":"object","properties":{"b":{},"a":{}}}'


def json_error(value: object) -> str:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError as error:
        return str(error)  # its wording differs between Python versions
    raise AssertionError(value)


JSON_INF_ERROR = json_error(float("inf"))


class NotAModel:
    """Has a pydantic-like method, but is an instance, not a model class."""

    def model_json_schema(self) -> dict[str, Any]:
        return {"type": "object"}


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            "{not json",
            "StructuredOutputsParams.json is not valid JSON (Expecting property name enclosed in "
            "double quotes: line 1 column 2 (char 1)): pass a JSON schema as a dict or as its "
            "JSON text.",
        ),
        (
            3,
            "StructuredOutputsParams.json=3 is invalid: expected a JSON schema: a dict, its "
            "JSON text or a pydantic model class.",
        ),
        (
            "[1, 2]",
            "StructuredOutputsParams.json='[1, 2]' is invalid: expected a JSON schema object "
            "({...}), not another JSON value.",
        ),
        (
            {"maximum": float("inf")},
            f"StructuredOutputsParams.json holds something that is not JSON ({JSON_INF_ERROR}): "
            "a schema is made of dicts, lists, strings, finite numbers, booleans and None.",
        ),
    ],
)
def test_a_schema_that_is_not_json_is_refused(schema: object, message: str) -> None:
    with pytest.raises(InvalidStructuredOutputError) as info:
        StructuredOutputsParams(json=schema)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_an_object_with_a_schema_method_is_not_a_model_class() -> None:
    with pytest.raises(InvalidStructuredOutputError, match=r"json=<.*NotAModel object"):
        StructuredOutputsParams(json=NotAModel())  # type: ignore[arg-type]


def test_the_repr_shows_the_fields_that_differ_from_their_defaults() -> None:
    assert repr(StructuredOutputsParams(regex="a+")) == "StructuredOutputsParams(regex='a+')"
    assert repr(StructuredOutputsParams(json={"type": "object"}, disable_fallback=True)) == (
        """StructuredOutputsParams(json='{"type":"object"}', disable_fallback=True)"""
    )


@pytest.mark.parametrize(("length", "cut"), [(200, False), (201, True)])
def test_long_values_are_cut_in_the_repr_and_in_messages(length: int, cut: bool) -> None:
    regex = "a" * (length - 2)  # repr: 'aa...a'
    shown = repr(regex) if not cut else f"{repr(regex)[:160]}... ({length} characters)"
    assert repr(StructuredOutputsParams(regex=regex)) == f"StructuredOutputsParams(regex={shown})"
    choice = ("a" * (length - 8), "")  # repr: ('aa...a', '')
    shown = repr(choice) if not cut else f"{repr(choice)[:160]}... ({length} characters)"
    with pytest.raises(InvalidStructuredOutputError) as info:
        StructuredOutputsParams(choice=choice)
    assert str(info.value) == (
        f"StructuredOutputsParams.choice={shown} is invalid: expected a non-empty list of "
        "non-empty strings."
    )
