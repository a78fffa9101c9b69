"""A finished answer as a Responses API ``response`` object: its output items (reasoning,
the message, function calls), status and usage.

Output items, in order: a ``reasoning`` item when the server has a reasoning parser and the
answer holds reasoning (its text as one ``reasoning_text`` part; no summary), a ``message``
with one ``output_text`` part (left out when the answer is only tool calls, or only
reasoning), then one ``function_call`` item per call. A response cut by
``max_output_tokens`` is ``incomplete`` with ``incomplete_details.reason =
"max_output_tokens"``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedinfer.serving.responses import Completion, Prompt
from pagedinfer.serving.responses_api.request import ResponsesRequest
from pagedinfer.serving.tools import ToolCalls
from pagedinfer.serving.translated import Reasoner, split_answer

__all__ = [
    "ResponseShape",
    "assistant_message",
    "function_call_item",
    "message_item",
    "new_id",
    "reasoning_item",
    "response_body",
    "response_usage",
]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class ResponseShape:
    """What every body of one response repeats: the request's settings, echoed."""

    response_id: str
    model: str
    request: ResponsesRequest
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        incomplete: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        request = self.request
        text = request.text if request.text is not None else {"format": {"type": "text"}}
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": (request.reasoning or {}).get("effort"), "summary": None},
            "service_tier": "auto",
            "store": request.store,
            "temperature": request.temperature,
            "text": text,
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "tools": list(request.tools or ()),
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
            "metadata": {},
        }


def response_usage(
    prompt: Prompt, completion: Completion, reasoning_tokens: int = 0
) -> dict[str, Any]:
    input_tokens = len(prompt.token_ids)
    output_tokens = len(completion.token_ids)
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": prompt.num_cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": content,
        "encrypted_content": None,
        "status": status,
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [output_text_part(text)],
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_body(
    shape: ResponseShape,
    prompt: Prompt,
    completion: Completion,
    tools: ToolCalls | None,
    reasoner: Reasoner | None,
    reasoning_tokens: int = 0,
) -> dict[str, Any]:
    """The whole response for a finished answer (``reasoning_tokens``: how many of its
    tokens are reasoning)."""
    split = split_answer(completion.text, reasoner, True)
    output: list[dict[str, Any]] = []
    if split.reasoning:
        output.append(reasoning_item(new_id("rs"), split.reasoning, "completed"))
    content: str = split.content
    calls: list[dict[str, Any]] = []
    if tools is not None:
        extracted = tools.extract(split.content)
        content = extracted.content or ""
        calls = [
            function_call_item(
                new_id("fc"), tools.format.new_id(), call.name, call.arguments, "completed"
            )
            for call in extracted.calls
        ]
    incomplete = "max_output_tokens" if completion.finish_reason == "length" else None
    status = "completed" if incomplete is None else "incomplete"
    if content.strip() or not (calls or split.reasoning):
        output.append(message_item(new_id("msg"), content, status))
    output.extend(calls)
    usage = response_usage(prompt, completion, reasoning_tokens)
    return shape.body(status, output, usage, incomplete)


def assistant_message(output: list[Mapping[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant turn of a later conversation
    (``previous_response_id``)."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        kind = item.get("type")
        if kind == "reasoning":
            message["reasoning_content"] = "".join(part["text"] for part in item["content"])
        elif kind == "message":
            message["content"] += "".join(part["text"] for part in item["content"])
        elif kind == "function_call":
            message.setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
    return message
