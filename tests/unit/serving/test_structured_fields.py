"""The structured-output fields of a request as one ``StructuredOutputsParams`` (vLLM's rules):
``response_format``, ``structured_outputs``, the older ``guided_*`` fields; one constraint per
request, knobs merged, every mistake a 400 naming its field. Pure Python: no server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagedinfer.domain.structured import StructuredOutputsParams
from pagedinfer.errors import InvalidStructuredOutputError
from pagedinfer.serving.fields import RequestFieldError
from pagedinfer.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_sampling_params,
    completion_sampling_params,
)
from pagedinfer.serving.structured import structured_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], **fields}
    )


@pytest.mark.parametrize("make", [_completion, _chat])
@pytest.mark.parametrize(
    ("fields", "expected", "field"),
    [
        ({"response_format": {"type": "json_object"}}, {"json_object": True}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            },
            {"json": SCHEMA},
            "response_format",
        ),
        (
            {"structured_outputs": {"regex": "[a-z]+"}},
            {"regex": "[a-z]+"},
            "structured_outputs.regex",
        ),
        (
            {"structured_outputs": {"choice": ["x", "y"]}},
            {"choice": ["x", "y"]},
            "structured_outputs.choice",
        ),
        ({"guided_json": SCHEMA}, {"json": SCHEMA}, "guided_json"),
        ({"guided_json": json.dumps(SCHEMA)}, {"json": SCHEMA}, "guided_json"),
        ({"guided_regex": "a+"}, {"regex": "a+"}, "guided_regex"),
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}, "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}, "guided_grammar"),
        (
            {
                "guided_json": SCHEMA,
                "guided_whitespace_pattern": " ?",
                "guided_decoding_backend": "auto",
            },
            {"json": SCHEMA, "whitespace_pattern": " ?"},
            "guided_json",
        ),
        (
            # response_format with structured_outputs' knobs (vLLM merges them)
            {
                "response_format": {"type": "json_object"},
                "structured_outputs": {"disable_any_whitespace": True},
            },
            {"json_object": True, "disable_any_whitespace": True},
            "response_format",
        ),
    ],
)
def test_each_field_becomes_the_constraint(
    make: Any, fields: dict[str, Any], expected: dict[str, Any], field: str
) -> None:
    request = make(**fields)
    structured = structured_request(request)
    assert structured is not None and structured.field == field
    assert structured.params == StructuredOutputsParams(**expected)
    build = completion_sampling_params if make is _completion else chat_sampling_params
    assert build(request, structured.params).structured_outputs == structured.params


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"response_format": {"type": "text"}},
        {"structured_outputs": {}},
        {"structured_outputs": {"json": None, "disable_any_whitespace": False}},
        {"guided_decoding_backend": "guidance"},
    ],
)
def test_fields_that_ask_for_nothing(fields: dict[str, Any]) -> None:
    assert structured_request(_chat(**fields)) is None


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format",
            "response_format and guided_regex both constrain",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs.choice",
            "both constrain",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA},
            "guided_json",
            "older spelling of structured_outputs.json",
        ),
        ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn", "not a structured"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "Remove the field"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
            "is required",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": 3}}},
            "response_format.json_schema.schema",
            "JSON schema object",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        (
            {"guided_regex": "a", "guided_whitespace_pattern": " "},
            "guided_whitespace_pattern",
            "applies to json and json_object only",
        ),
        (
            {"structured_outputs": {"disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
            "asks for none",
        ),
    ],
)
def test_each_mistake_is_a_400_naming_its_field(
    fields: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(RequestFieldError, match=message) as error:
        structured_request(_completion(**fields))
    assert error.value.param == param


def test_a_constraint_that_does_not_compile_names_its_field() -> None:
    structured = structured_request(_chat(guided_regex="a"))
    assert structured is not None
    error = structured.error(InvalidStructuredOutputError("the regex does not compile: ..."))
    assert error.param == "guided_regex" and "does not compile" in str(error)


def test_a_constraint_with_settings_it_contradicts_names_them() -> None:
    """ignore_eos, min_tokens and allowed_token_ids cannot go with a constraint (each could
    leave no token allowed): SamplingParams says so, naming the field."""
    request = _completion(guided_regex="a+", ignore_eos=True)
    structured = structured_request(request)
    assert structured is not None
    with pytest.raises(ValueError, match=r"SamplingParams\.ignore_eos"):
        completion_sampling_params(request, structured.params)


def test_tool_calls_take_the_requests_json_knobs_and_no_other_constraint() -> None:
    tools = StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?")
    alone = structured_request(_chat(), tools)
    assert alone is not None and alone.params == tools and alone.field == "tools"
    knobs = {"disable_any_whitespace": True, "disable_additional_properties": True}
    merged = structured_request(_chat(structured_outputs=knobs), tools)
    assert merged is not None
    assert merged.params == StructuredOutputsParams(json=SCHEMA, **knobs)  # no " ?" rule
    request = _chat(tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(RequestFieldError, match="tool_choice='required' both constrain") as error:
        structured_request(request, tools)
    assert error.value.param == "response_format"
