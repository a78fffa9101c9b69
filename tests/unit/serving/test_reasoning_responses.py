"""Chat answers of a thinking model as the server sends them (``--reasoning-parser``):
``reasoning_content`` beside ``content``, whole and streamed, and tool calls read from the
content only. Pure Python: engine outputs built by hand, no model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagedinfer.engine.outputs import CompletionOutput, RequestOutput
from pagedinfer.serving.reasoning import Qwen3ReasoningParser
from pagedinfer.serving.responses import (
    ChoiceCursor,
    ResponseContext,
    chat_chunk,
    chat_response,
    completions_of,
    prompt_of,
)
from pagedinfer.serving.tools import ToolCalls
from pagedinfer.serving.tools.formats import HermesFormat

CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
# The reasoning mentions a call; only the one in the content is made.
ANSWER = (
    '<think>\nI could write <tool_call>{"name": "f", "arguments": {}}</tool_call>.\n</think>\n\n'
    f"Sure.{CALL}<|im_end|>"
)


def _context(**fields: Any) -> ResponseContext:
    return ResponseContext(
        response_id="chatcmpl-1",
        model="m",
        created=0,
        token_text=str,
        num_logprobs=None,
        reasoning=Qwen3ReasoningParser(),
        **fields,
    )


def _output(text: str, finish_reason: str | None = "stop") -> RequestOutput:
    completion = CompletionOutput(0, text, [1] * len(text), None, None, finish_reason)
    return RequestOutput("0", "p", [1], None, [completion], finish_reason is not None, 0)


def _tools() -> ToolCalls:
    return ToolCalls(HermesFormat(), "auto", end_texts=("<|im_end|>",))


def _stream(context: ResponseContext, text: str, finish_reason: str) -> list[dict[str, Any]]:
    """The chunks of ``text`` arriving one character at a time."""
    cursor = ChoiceCursor()
    chunks = []
    for size in range(1, len(text) + 1):
        output = _output(text[:size], finish_reason if size == len(text) else None)
        for completion in completions_of(output):
            chunk = chat_chunk(context, completion, cursor, prompt_of(output))
            if chunk is not None:
                chunks.append(chunk["choices"][0])
    return chunks


def _joined(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join(chunk["delta"].get(key) or "" for chunk in chunks)


def test_a_whole_answer_has_reasoning_content_and_content() -> None:
    message = chat_response(_context(), _output("<think>\nhmm\n</think>\n\nParis."))["choices"][0][
        "message"
    ]
    assert message["reasoning_content"] == message["reasoning"] == "\nhmm\n"
    assert message["content"] == "\n\nParis."


def test_an_answer_cut_mid_thought_is_all_reasoning_and_no_content() -> None:
    choice = chat_response(_context(), _output("<think>\nstill thin", "length"))["choices"][0]
    assert choice["message"]["reasoning_content"] == "\nstill thin"
    assert choice["message"]["content"] is None
    assert choice["finish_reason"] == "length"


def test_include_reasoning_false_leaves_the_reasoning_out() -> None:
    context = _context(include_reasoning=False)
    message = chat_response(context, _output("<think>a</think>b"))["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"] == "b"
    chunks = _stream(context, "<think>a</think>b", "stop")
    assert _joined(chunks, "reasoning_content") == "" and _joined(chunks, "content") == "b"


def test_an_answer_that_does_not_think_is_content() -> None:
    context = _context(thinking=False)
    message = chat_response(context, _output("<think>a</think>b"))["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"] == "<think>a</think>b"


@pytest.mark.parametrize(
    ("text", "finish_reason"),
    [
        ("<think>\nhmm\n</think>\n\nParis.", "stop"),
        ("<think>\nstill thin", "length"),
        ("no tags", "length"),
        ("</think>x", "stop"),
    ],
)
def test_the_streamed_deltas_add_up_to_the_whole_answer(text: str, finish_reason: str) -> None:
    context = _context()
    whole = chat_response(context, _output(text, finish_reason))["choices"][0]
    chunks = _stream(context, text, finish_reason)
    assert _joined(chunks, "reasoning_content") == (whole["message"]["reasoning_content"] or "")
    assert _joined(chunks, "reasoning") == _joined(chunks, "reasoning_content")
    assert _joined(chunks, "content") == (whole["message"]["content"] or "")
    assert chunks[0]["delta"]["role"] == "assistant"
    assert [chunk["finish_reason"] for chunk in chunks][-1] == finish_reason
    assert not any("<think>" in json.dumps(chunk) for chunk in chunks)


def test_tool_calls_are_read_from_the_content_only() -> None:
    context = _context(tool_calls=_tools())
    choice = chat_response(context, _output(ANSWER))["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"].startswith("\nI could write <tool_call>")
    assert message["content"] == "\n\nSure."
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_time"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"zone": "UTC"}
    assert choice["finish_reason"] == "tool_calls"


def test_streamed_tool_calls_are_read_from_the_content_only() -> None:
    chunks = _stream(_context(tool_calls=_tools()), ANSWER, "stop")
    assert _joined(chunks, "reasoning_content").startswith("\nI could write <tool_call>")
    assert _joined(chunks, "content") == "\n\nSure."
    calls = [call for chunk in chunks for call in chunk["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_time"
    arguments = "".join(call["function"]["arguments"] for call in calls)
    assert json.loads(arguments) == {"zone": "UTC"}
    assert {call["index"] for call in calls} == {0}
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_an_eos_text_ending_a_thought_is_not_reasoning() -> None:
    context = _context(tool_calls=_tools())
    message = chat_response(context, _output("<think>hmm<|im_end|>"))["choices"][0]["message"]
    assert message["reasoning_content"] == "hmm" and message["content"] is None
    chunks = _stream(context, "<think>hmm<|im_end|>", "stop")
    assert _joined(chunks, "reasoning_content") == "hmm"
