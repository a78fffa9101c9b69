"""A finished answer as an Anthropic ``message``, and a streamed one as the Messages API's
events.

Content blocks, in order: a ``thinking`` block when the server has a reasoning parser and the
answer holds reasoning, a ``text`` block (left out when the answer is only tool calls, or only
reasoning), then
one ``tool_use`` block per call (``input``: the arguments object). ``stop_reason``:
``max_tokens`` (cut by ``max_tokens`` or ``max_model_len``), ``stop_sequence`` (with the
matched ``stop_sequence``), ``tool_use`` (calls were made) or ``end_turn``. ``usage``:
``input_tokens`` (the prompt tokens the prefix cache did not serve),
``cache_read_input_tokens`` (those it did), ``output_tokens``.

A stream is ``message_start``, then per block ``content_block_start``,
``content_block_delta``... (``text_delta``, ``thinking_delta``, ``input_json_delta``) and
``content_block_stop``, then ``message_delta`` (the stop reason, the output tokens) and
``message_stop``; a failure ends it with an ``error`` event.
"""

from __future__ import annotations

import json
from typing import Any

from pagedinfer.serving.responses import Completion, Prompt
from pagedinfer.serving.tools import ToolCalls, ToolCallStream
from pagedinfer.serving.translated import Reasoner, split_answer

__all__ = ["MessageEvents", "message_body", "stop_reason"]


def stop_reason(completion: Completion, called: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a finished answer."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        arguments_object = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        arguments_object = {}
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments_object}


def message_body(
    message_id: str,
    model: str,
    prompt: Prompt,
    completion: Completion,
    tools: ToolCalls | None,
    reasoner: Reasoner | None,
) -> dict[str, Any]:
    """The whole message for a finished answer."""
    split = split_answer(completion.text, reasoner, True)
    content: list[dict[str, Any]] = []
    if split.reasoning:
        content.append({"type": "thinking", "thinking": split.reasoning, "signature": ""})
    text, calls = split.content, []
    if tools is not None:
        extracted = tools.extract(split.content)
        text = extracted.content or ""
        calls = [
            _tool_use(tools.format.new_id(), call.name, call.arguments) for call in extracted.calls
        ]
    if text.strip() or not (calls or split.reasoning):
        content.append({"type": "text", "text": text})
    content.extend(calls)
    reason, sequence = stop_reason(completion, bool(calls))
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(len(prompt.token_ids), prompt.num_cached_tokens, len(completion.token_ids)),
    }


def event(body: dict[str, Any]) -> str:
    return f"event: {body['type']}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


class MessageEvents:
    """The events of one streamed message, from its answer's growing text."""

    def __init__(
        self,
        message_id: str,
        model: str,
        prompt_tokens: int,
        tools: ToolCalls | None,
        reasoner: Reasoner | None,
    ) -> None:
        self._id = message_id
        self._model = model
        self._prompt_tokens = prompt_tokens
        self._tools: ToolCallStream | None = None if tools is None else tools.stream()
        self._reasoner = reasoner
        self._blocks = 0  # blocks opened
        self._open: str | None = None  # the open block's type
        self._reasoning = 0
        self._content = 0
        self._pending = ""  # leading whitespace, held until the text shows
        self._texts = 0  # text blocks opened
        self._calls: dict[int, int] = {}  # a tool-call delta's index -> its block index

    def started(self) -> list[str]:
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(self._prompt_tokens, 0, 0),
        }
        return [event({"type": "message_start", "message": message})]

    def advance(self, completion: Completion) -> list[str]:
        final = completion.finish_reason is not None
        split = split_answer(completion.text, self._reasoner, final)
        events: list[str] = []
        thinking = split.reasoning[self._reasoning :]
        if thinking:
            self._reasoning = len(split.reasoning)
            self._block("thinking", {"type": "thinking", "thinking": ""}, events)
            self._delta({"type": "thinking_delta", "thinking": thinking}, events)
        if self._tools is not None:
            text, deltas = self._tools.advance(split.content, final)
        else:
            text, deltas = split.content[self._content :], []
            self._content = len(split.content)
        if self._open != "text":
            self._pending += text
            flush = final and not self._calls and not deltas
            text = self._pending if self._pending.strip() or flush else ""
            if text:
                self._pending = ""
        if text:
            self._block("text", {"type": "text", "text": ""}, events)
            self._delta({"type": "text_delta", "text": text}, events)
        for delta in deltas:
            function = delta.get("function", {})
            if "id" in delta:
                block = {
                    "type": "tool_use",
                    "id": delta["id"],
                    "name": function.get("name", ""),
                    "input": {},
                }
                self._block(None, block, events)
                self._calls[delta["index"]] = self._blocks - 1
            fragment = function.get("arguments") or ""
            if fragment:
                self._delta({"type": "input_json_delta", "partial_json": fragment}, events)
        if final:
            if not self._texts and not self._calls and not self._reasoning:
                self._block("text", {"type": "text", "text": ""}, events)
            self._stop(events)
            reason, sequence = stop_reason(completion, bool(self._calls))
            events.append(
                event(
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": {"output_tokens": len(completion.token_ids)},
                    }
                )
            )
            events.append(event({"type": "message_stop"}))
        return events

    @staticmethod
    def failed(error: dict[str, Any]) -> list[str]:
        kind = "api_error" if error.get("type") == "server_error" else "invalid_request_error"
        return [event({"type": "error", "error": {"type": kind, "message": error["message"]}})]

    def _block(self, kind: str | None, block: dict[str, Any], events: list[str]) -> None:
        """Open a block (``kind`` None: always a new one), closing the open one."""
        if kind is not None and self._open == kind:
            return
        self._stop(events)
        self._open = kind or block["type"]
        if block["type"] == "text":
            self._texts += 1
        events.append(
            event({"type": "content_block_start", "index": self._blocks, "content_block": block})
        )
        self._blocks += 1

    def _delta(self, delta: dict[str, Any], events: list[str]) -> None:
        events.append(
            event({"type": "content_block_delta", "index": self._blocks - 1, "delta": delta})
        )

    def _stop(self, events: list[str]) -> None:
        if self._open is not None:
            events.append(event({"type": "content_block_stop", "index": self._blocks - 1}))
            self._open = None
