"""Qwen3-Coder's XML tool calls (``--tool-call-parser qwen3_coder``), read whole and streamed
at every character boundary. Pure Python."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.property.profiles import sized
from tests.unit.serving.test_tool_calls import _pieces, _reassemble

from pagedinfer.serving.tools import TOOL_CALL_PARSERS, ToolCallStream, plan_tools
from pagedinfer.serving.tools.formats import Extracted, ParsedCall
from pagedinfer.serving.tools.qwen3_coder import Qwen3CoderFormat

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "scale": {"type": "number"},
                    "hourly": {"type": "boolean"},
                    "where": {"type": "object"},
                    "hours": {"type": "array"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
FORMAT = Qwen3CoderFormat(TOOLS)
WEATHER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=scale>\n2.5\n</parameter>\n"
    '<parameter=hourly>\nTrue\n</parameter>\n<parameter=where>\n{"lat": 1, "lon": [2]}\n'
    "</parameter>\n<parameter=hours>\n[1, 'two']\n</parameter>\n<parameter=note>\nnull\n"
    "</parameter>\n</function>\n</tool_call>"
)
WEATHER_ARGUMENTS = {
    "city": "San Francisco",
    "days": 3,
    "scale": 2.5,
    "hourly": True,
    "where": {"lat": 1, "lon": [2]},
    "hours": [1, "two"],  # a Python literal, as vLLM reads it
    "note": None,
}
TIME = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"

# (text, content, [(name, arguments as a dict)])
WHOLE: list[tuple[str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    (
        f"Let me check.\n\n{WEATHER}\n{TIME}",
        "Let me check.",
        [("get_weather", WEATHER_ARGUMENTS), ("get_time", {})],
    ),
    (TIME, None, [("get_time", {})]),
    # No closing </parameter> (the next tag ends the value), no </tool_call>, bare <function=.
    (
        "<function=get_weather><parameter=city>Oslo<parameter=days>x</function>",
        None,
        [("get_weather", {"city": "Oslo", "days": "x"})],  # not an integer: kept as text
    ),
    # A multi-line value keeps its inner newlines; a parameter the schema lacks is text.
    (
        "<tool_call><function=other><parameter=code>\ndef f():\n    return 1\n\n</parameter>"
        "</function>",
        None,
        [("other", {"code": "def f():\n    return 1\n"})],
    ),
    ("Just text, <b>no call</b> <tool", "Just text, <b>no call</b> <tool", []),
]

MALFORMED = [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo",  # cut short
    "<tool_call>\n<function=get weather!>\n</function>",  # no name
    "<tool_call>\nnot a function</tool_call>",
    "<tool_call>\n<function=get_time>\nstray text</function>",
]


def _calls(extracted: Extracted) -> list[tuple[str, dict[str, Any]]]:
    return [(call.name, json.loads(call.arguments)) for call in extracted.calls]


@pytest.mark.parametrize(("text", "content", "calls"), WHOLE)
def test_a_whole_answer_has_its_calls_and_content(
    text: str, content: str | None, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    extracted = FORMAT.extract(text)
    assert extracted.content == (content if calls else text)
    assert _calls(extracted) == calls


@pytest.mark.parametrize("text", MALFORMED)
def test_a_malformed_call_leaves_the_text_as_content(text: str) -> None:
    assert FORMAT.extract(text) == Extracted(text)


@pytest.mark.parametrize(("text", "content", "calls"), WHOLE)
def test_streamed_at_every_boundary_the_deltas_add_up(
    text: str, content: str | None, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    whole = FORMAT.extract(text)
    expected = [(call.name, call.arguments) for call in whole.calls]
    for cut in range(len(text) + 1):
        streamed_content, streamed = _reassemble(ToolCallStream(FORMAT), _pieces(text, [cut]))
        assert streamed == expected
        assert streamed_content == (whole.content or "")
    # One character at a time.
    assert _reassemble(ToolCallStream(FORMAT), list(text))[1] == expected


SIZES = {
    "ci": {"max_examples": 60},
    "quick": {"max_examples": 10},
    "thorough": {"max_examples": 2000},
}


@sized(SIZES)
@given(
    st.sampled_from(WHOLE + [(text, text, []) for text in MALFORMED]),
    st.lists(st.integers(0, 10_000), max_size=12),
)
def test_any_chunking_adds_up_to_the_whole_answer(
    case: tuple[str, str | None, list[tuple[str, dict[str, Any]]]], cuts: list[int]
) -> None:
    text = case[0]
    whole = FORMAT.extract(text)
    stream = ToolCallStream(FORMAT)
    content, calls = _reassemble(stream, _pieces(text, cuts))
    assert calls == [(call.name, call.arguments) for call in whole.calls] or not whole.calls
    assert content == (whole.content or "")
    assert stream.called == bool(whole.calls)


def test_the_parser_is_registered_and_gets_the_tools() -> None:
    assert TOOL_CALL_PARSERS["qwen3_coder"] is Qwen3CoderFormat
    plan = plan_tools(TOOLS, "auto", None, parser="qwen3_coder", auto_tool_choice=True)
    assert plan.calls is not None and plan.keeps_special_tokens
    extracted = plan.calls.extract("<function=get_weather><parameter=days>4</function>")
    assert extracted.calls == (ParsedCall("get_weather", '{"days": 4}'),)
