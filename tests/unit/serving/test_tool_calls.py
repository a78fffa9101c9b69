"""Tool calls read from generated text (``--tool-call-parser``), streamed as OpenAI deltas, and
what ``tools`` / ``tool_choice`` ask for. Pure Python: no server, no model.

Every family's format is read whole (several calls, text before them, malformed text as
content) and streamed: fed in pieces of any size, the deltas add up to the whole answer's
calls and content.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedinfer.serving.fields import RequestFieldError
from pagedinfer.serving.tools import ToolCallStream, plan_tools, template_tools
from pagedinfer.serving.tools.formats import (
    Extracted,
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    NamedCallFormat,
    ParsedCall,
    RequiredCallsFormat,
    ToolCallFormat,
)
from pagedinfer.serving.tools.scan import scan_object

WEATHER = ParsedCall("get_weather", '{"city": "Paris", "days": [1, 2], "q": "a \\"}\\" b"}')
TIME = ParsedCall("get_time", "{}")

# (format, text, what it holds)
WHOLE: list[tuple[ToolCallFormat, str, Extracted]] = [
    # Hermes / Qwen2.5 / Qwen3
    (
        HermesFormat(),
        f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER.arguments}}}'
        '\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>',
        Extracted("Let me look.", (WEATHER, TIME)),
    ),
    (
        HermesFormat(),
        '<tool_call>{"name": "get_time", "arguments": {}}',  # the last end tag may be missing
        Extracted(None, (TIME,)),
    ),
    (
        HermesFormat(),
        "Plain text, <b>no call</b> <tool",
        Extracted("Plain text, <b>no call</b> <tool"),
    ),
    # Llama 3.x JSON
    (
        Llama3JsonFormat(),
        f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER.arguments}}}; '
        '{"name": "get_time", "parameters": {}}',
        Extracted(None, (WEATHER, TIME)),
    ),
    (Llama3JsonFormat(), ' {"name": "get_time"}', Extracted(None, (TIME,))),
    (Llama3JsonFormat(), "The answer is {x}.", Extracted("The answer is {x}.")),
    # Mistral: a JSON array after [TOOL_CALLS], or name[ARGS]{...} per call (tokenizers v11+)
    (
        MistralFormat(),
        f'Sure. [TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER.arguments}}}, '
        '{"name": "get_time", "arguments": {}}]',
        Extracted("Sure.", (WEATHER, TIME)),
    ),
    (
        MistralFormat(),
        f"[TOOL_CALLS]get_weather[ARGS]{WEATHER.arguments}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{{}}",
        Extracted(None, (WEATHER, TIME)),
    ),
    # tool_choice="required" (a JSON array) and a named function (its arguments)
    (
        RequiredCallsFormat(),
        f'[{{"name": "get_weather", "parameters": {WEATHER.arguments}}}, '
        '{"name": "get_time", "parameters": {}}]',
        Extracted(None, (WEATHER, TIME)),
    ),
    (NamedCallFormat("get_weather"), " " + WEATHER.arguments, Extracted(None, (WEATHER,))),
]

# Text that starts like calls but is not: the whole text is the content, with no call.
MALFORMED: list[tuple[ToolCallFormat, str]] = [
    (HermesFormat(), '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>'),  # not JSON
    (HermesFormat(), '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),  # name no string
    (HermesFormat(), '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # no object
    (HermesFormat(), '<tool_call>{"name": "f", "arguments": {"a": 1}'),  # cut short
    (HermesFormat(), '<tool_call>{"name": "f"} trailing</tool_call>'),
    (HermesFormat(), "<tool_call>not json</tool_call>"),
    (Llama3JsonFormat(), '{"city": "Paris"}'),  # JSON, but no call
    (Llama3JsonFormat(), '{"name": "f", "parameters": {}} and then text'),
    (MistralFormat(), '[TOOL_CALLS][{"name": "f", "arguments": {}}'),  # array not closed
    (MistralFormat(), "[TOOL_CALLS]not a name![ARGS]{}"),
    (RequiredCallsFormat(), "[]"),  # minItems 1
    (RequiredCallsFormat(), '[{"name": "f", "parameters": {"a": 1}'),  # cut by max_tokens
]


@pytest.mark.parametrize(("format", "text", "expected"), WHOLE)
def test_each_family_reads_its_calls_and_content(
    format: ToolCallFormat, text: str, expected: Extracted
) -> None:
    assert format.extract(text) == expected


@pytest.mark.parametrize(("format", "text"), MALFORMED)
def test_malformed_calls_leave_the_text_as_content(format: ToolCallFormat, text: str) -> None:
    assert format.extract(text) == Extracted(text)


def _reassemble(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed the growing text piece by piece; put the deltas back together as a client does."""
    content = ""
    calls: dict[int, list[str]] = {}
    text = ""
    for number, piece in enumerate(pieces):
        text += piece
        new, deltas = stream.advance(text, final=number == len(pieces) - 1)
        content += new
        for delta in deltas:
            index = delta["index"]
            if index not in calls:
                assert set(delta) == {"index", "id", "type", "function"}  # the first delta
                assert delta["type"] == "function" and delta["id"]
                assert index == len(calls)  # calls come in order
                calls[index] = [delta["function"]["name"], delta["function"]["arguments"]]
            else:
                assert set(delta) == {"index", "function"}
                assert set(delta["function"]) == {"arguments"} and delta["function"]["arguments"]
                calls[index][1] += delta["function"]["arguments"]
    return content, [(name, arguments) for name, arguments in calls.values()]


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, *(c % (len(text) + 1) for c in cuts), len(text)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(WHOLE), cuts=st.lists(st.integers(0, 10_000), max_size=40))
def test_streamed_deltas_add_up_to_the_whole_answer(
    case: tuple[ToolCallFormat, str, Extracted], cuts: list[int]
) -> None:
    format, text, expected = case
    stream = ToolCallStream(format)
    content, calls = _reassemble(stream, _pieces(text, cuts))
    assert calls == [(call.name, call.arguments) for call in expected.calls]
    assert content == (expected.content or "")
    assert stream.called == bool(expected.calls)


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(MALFORMED), cuts=st.lists(st.integers(0, 10_000), max_size=20))
def test_a_malformed_stream_ends_with_the_text_as_content(
    case: tuple[ToolCallFormat, str], cuts: list[int]
) -> None:
    format, text = case
    stream = ToolCallStream(format)
    content, _ = _reassemble(stream, _pieces(text, cuts))
    assert content == text
    assert not stream.called


def test_text_that_may_start_a_marker_is_held_back() -> None:
    stream = ToolCallStream(HermesFormat())
    assert stream.advance("Hello <tool", final=False) == ("Hello", [])
    content, deltas = stream.advance('Hello <tool_call>{"name": "get_ti', final=False)
    assert (content, deltas) == ("", [])  # the name is not complete yet
    content, deltas = stream.advance('Hello <tool_call>{"name": "get_time", "arguments": {', False)
    assert content == ""
    assert deltas[0]["function"] == {"name": "get_time", "arguments": "{"}


def test_only_the_first_call_without_parallel_tool_calls() -> None:
    format, text, expected = WHOLE[0]
    stream = ToolCallStream(format, parallel=False)
    _, calls = _reassemble(stream, [text])
    assert calls == [(expected.calls[0].name, expected.calls[0].arguments)]


def test_the_eos_text_of_an_answer_decoded_with_special_tokens_is_dropped() -> None:
    text = "No call needed.</s>"
    content, _ = _reassemble(ToolCallStream(MistralFormat(), end_texts=("</s>",)), list(text))
    assert content == "No call needed."


def test_mistral_answers_keep_special_tokens_but_not_the_eos_text() -> None:
    """[TOOL_CALLS] is a special token: the answer is decoded with special tokens (unless the
    request sets skip_special_tokens), and the EOS text that then ends it is left out."""
    from pagedinfer.serving.protocol import ChatCompletionRequest, chat_sampling_params

    plan = plan_tools(TOOLS, "auto", None, parser="mistral", auto_tool_choice=True,
                      end_texts=("</s>",))  # fmt: skip
    assert plan.calls.extract("No call.</s>") == Extracted("No call.")
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]</s>'
    assert plan.calls.extract(text) == Extracted(None, (TIME,))
    body = {"messages": [{"role": "user", "content": "x"}]}
    request = ChatCompletionRequest.model_validate(body)
    assert not chat_sampling_params(request, keep_special_tokens=True).skip_special_tokens
    request = ChatCompletionRequest.model_validate({**body, "skip_special_tokens": True})
    assert chat_sampling_params(request, keep_special_tokens=True).skip_special_tokens
    llama = plan_tools(TOOLS, "auto", None, parser="llama3_json", auto_tool_choice=True,
                       end_texts=("</s>",))  # fmt: skip
    assert not llama.keeps_special_tokens and llama.calls.end_texts == ()


def test_mistral_ids_are_nine_letters_and_digits() -> None:
    for _ in range(20):
        call_id = MistralFormat().new_id()
        assert len(call_id) == 9 and call_id.isalnum()
    assert HermesFormat().new_id().startswith("call_")


def test_objects_are_scanned_as_far_as_they_go() -> None:
    text = '{"name": "f", "arguments": {"a": "}", "b": [1, {"c": 2}]}, "x": 1'
    found = scan_object(text, 0)
    assert found.end is None and not found.error
    assert [m.key for m in found.members] == ["name", "arguments", "x"]
    assert found.member("arguments").raw(text) == '{"a": "}", "b": [1, {"c": 2}]}'  # type: ignore[union-attr]
    assert scan_object('{"a" 1}', 0).error
    assert scan_object('{"a": 1} ', 0).end == 8


# ------------------------------------------------------------------ tools, tool_choice
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"$ref": "#/$defs/City"}},
                "required": ["city"],
                "$defs": {"City": {"type": "string", "enum": ["Paris", "Rome"]}},
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def _plan(choice: Any, parallel: bool | None = None, **server: Any) -> Any:
    options = {"parser": "hermes", "auto_tool_choice": True, **server}
    return plan_tools(TOOLS, choice, parallel, **options)


def test_required_decodes_an_array_of_calls_under_their_schemas() -> None:
    plan = _plan("required")
    schema = json.loads(plan.constraint.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert first["required"] == ["name", "parameters"]
    assert first["additionalProperties"] is False  # a call is its name and parameters only
    # A tool with $refs moves to the root's $defs under its name, its $refs rewritten to
    # resolve there as they did in its own schema.
    assert first["properties"]["parameters"] == {"$ref": "#/$defs/get_weather"}
    moved = schema["$defs"]["get_weather"]
    assert moved["properties"]["city"] == {"$ref": "#/$defs/get_weather/$defs/City"}
    assert moved["$defs"] == {"City": {"type": "string", "enum": ["Paris", "Rome"]}}
    assert set(schema["$defs"]) == {"get_weather"}
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert plan.constraint.whitespace_pattern == " ?"
    assert plan.calls.finish_reason("stop", called=True) == "tool_calls"
    assert plan.calls.finish_reason("length", called=False) == "length"
    assert json.loads(_plan("required", parallel=False).constraint.json)["maxItems"] == 1
    assert TOOLS[0]["function"]["parameters"]["$defs"]  # the request's tools are not changed


def test_a_named_function_decodes_its_arguments() -> None:
    plan = _plan({"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(plan.constraint.json) == TOOLS[0]["function"]["parameters"]
    assert plan.calls.extract('{"city": "Rome"}').calls == (
        ParsedCall("get_weather", '{"city": "Rome"}'),
    )
    assert plan.calls.finish_reason("stop", called=True) == "stop"  # OpenAI's and vLLM's


def test_auto_reads_calls_with_the_servers_parser() -> None:
    for choice in ("auto", None):
        plan = _plan(choice)
        assert plan.constraint is None and isinstance(plan.calls.format, HermesFormat)
        assert plan.calls.finish_reason("stop", called=True) == "tool_calls"
        assert plan.calls.finish_reason("stop", called=False) == "stop"
    plan = _plan("auto", parser="mistral")
    assert plan.keeps_special_tokens and isinstance(plan.calls.format, MistralFormat)
    plan = _plan("none")
    assert plan.calls is None and plan.constraint is None and plan.tools == TOOLS


@pytest.mark.parametrize(
    ("tools", "choice", "server", "param", "message"),
    [
        (TOOLS, "auto", {"auto_tool_choice": False}, "tool_choice", "--enable-auto-tool-choice"),
        (TOOLS, None, {"parser": None}, "tool_choice", "--tool-call-parser"),
        (None, "required", {}, "tool_choice", "needs tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, {}, "tool_choice", "not among"),
        (TOOLS, "sometimes", {}, "tool_choice", "not supported"),
        (TOOLS, {"type": "function", "function": {}}, {}, "tool_choice", "names no function"),
        ([{"type": "custom", "custom": {}}], "none", {}, "tools[0].type", "only function"),
        (
            [{"type": "function", "function": {"name": "a b"}}],
            "none",
            {},
            "tools[0].function.name",
            "invalid",
        ),
        ([TOOLS[1], TOOLS[1]], "none", {}, "tools[1].function.name", "two tools"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "none",
            {},
            "tools[0].function.parameters",
            "JSON schema",
        ),
    ],
)
def test_tool_requests_that_cannot_be_served_are_400s_naming_the_field(
    tools: Any, choice: Any, server: dict[str, Any], param: str, message: str
) -> None:
    options = {"parser": "hermes", "auto_tool_choice": True, **server}
    with pytest.raises(RequestFieldError, match=message) as error:
        plan_tools(tools, choice, None, **options)
    assert error.value.param == param


def test_no_tools_is_no_tool_calling() -> None:
    for tools in (None, []):
        assert template_tools(tools) is None
        for choice in (None, "none", "auto"):
            plan = plan_tools(tools, choice, None, parser=None, auto_tool_choice=False)
            assert plan.calls is None and plan.constraint is None
