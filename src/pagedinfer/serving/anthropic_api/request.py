"""The body of ``POST /v1/messages`` (Anthropic's Messages API) and its translation into the
chat request the server already serves.

``system`` becomes the system message; ``messages`` (roles ``user`` and ``assistant``,
content a string or blocks) the conversation: ``text`` blocks are joined, an assistant's
``tool_use`` blocks become its ``tool_calls``, a user's ``tool_result`` blocks ``tool``
messages, ``thinking`` blocks the assistant turn's ``reasoning_content``. ``max_tokens`` (
required, as Anthropic's), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` map to
chat's fields; ``tools`` (``{"name", "description", "input_schema"}``) and ``tool_choice``
(``auto``, ``any``, ``tool``, ``none``; ``disable_parallel_tool_use``) to chat's tools.
Images, documents, server tools and extended-thinking budgets are 400s naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedinfer.serving.fields import RequestFieldError
from pagedinfer.serving.protocol import ChatCompletionRequest, Float32, Int64

__all__ = ["MessagesRequest", "chat_request", "check_message_fields"]

# Fields that only describe the request: accepted and ignored.
_IGNORED = frozenset({"metadata", "service_tier", "container", "context_management"})


class MessagesRequest(BaseModel):
    """``POST /v1/messages``; other fields land in ``model_extra``."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: Int64
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: Float32 | None = None
    top_p: Float32 | None = None
    top_k: Int64 | None = None
    stream: bool = False
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def check_message_fields(request: MessagesRequest) -> None:
    """Refuse what the server cannot serve (a 400 naming the field)."""
    for name in request.model_extra or {}:
        if name not in _IGNORED:
            raise _bad(
                name,
                f"Unrecognized request argument supplied: {name}. Remove it, or check its "
                "spelling (docs/serving.md lists the fields /v1/messages accepts)",
            )
    thinking = request.thinking
    if thinking is not None and thinking.get("type") not in ("disabled", None):
        raise _bad(
            "thinking",
            "thinking budgets are not supported: the model thinks as its chat template lets "
            'it (send {"type": "disabled"} or leave thinking out)',
        )


def chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that answers ``request``."""
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": conversation(request),
        "max_tokens": request.max_tokens,
        "stream": request.stream,
    }
    if request.stop_sequences:
        fields["stop"] = request.stop_sequences
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(request, name)
        if value is not None:
            fields[name] = value
    if request.tools:
        fields["tools"] = _chat_tools(request.tools)
    choice = request.tool_choice
    if choice is not None:
        fields["tool_choice"] = _chat_tool_choice(choice)
        if choice.get("disable_parallel_tool_use"):
            fields["parallel_tool_calls"] = False
    if request.thinking is not None and request.thinking.get("type") == "disabled":
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from None


def conversation(request: MessagesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.system:
        system = request.system
        text = system if isinstance(system, str) else _texts(system, "system")
        messages.append({"role": "system", "content": text})
    for index, message in enumerate(request.messages):
        where = f"messages[{index}]"
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _bad(
                f"{where}.role", f"{where}.role={role!r} is not supported: user or assistant"
            )
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content", f"{where}.content must be a string or a list of blocks")
        messages.extend(_blocks(role, content, where))
    return messages


def _blocks(role: str, blocks: Sequence[Any], where: str) -> list[dict[str, Any]]:
    """One message's content blocks as chat messages (tool results are messages of their
    own, before the user's text)."""
    turn: dict[str, Any] = {"role": role, "content": ""}
    results: list[dict[str, Any]] = []
    for position, block in enumerate(blocks):
        at = f"{where}.content[{position}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and isinstance(block.get("text"), str):
            turn["content"] += block["text"]
        elif kind == "tool_use" and role == "assistant":
            assert isinstance(block, Mapping)
            turn.setdefault("tool_calls", []).append(
                {
                    "id": _string(block, "id", at),
                    "type": "function",
                    "function": {
                        "name": _string(block, "name", at),
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            assert isinstance(block, Mapping)
            output = block.get("content", "")
            text = output if isinstance(output, str) else _texts(output, f"{at}.content")
            results.append(
                {"role": "tool", "tool_call_id": _string(block, "tool_use_id", at), "content": text}
            )
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            assert isinstance(block, Mapping)
            thinking = block.get("thinking")
            if isinstance(thinking, str):
                turn["reasoning_content"] = turn.get("reasoning_content", "") + thinking
        else:
            raise _bad(
                at,
                f"{at} of type {kind!r} is not supported here: text, tool_use (assistant), "
                "tool_result (user) and thinking (assistant) blocks are (text-only models)",
            )
    if turn["content"] or "tool_calls" in turn or not results:
        return [*results, turn]
    return results


def _chat_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    chat = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, Mapping) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise _bad(
                f"{where}.type",
                f"{where}.type={kind!r} is not supported: this server has no server tools; "
                'only custom tools ({"name", "description", "input_schema"}) are',
            )
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        chat.append({"type": "function", "function": function})
    return chat


def _chat_tool_choice(choice: Mapping[str, Any]) -> str | dict[str, Any]:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return str(kind)
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise _bad(
        "tool_choice", f"tool_choice.type={kind!r} is not supported: auto, any, tool or none"
    )


def _texts(blocks: Any, where: str) -> str:
    if not isinstance(blocks, list):
        raise _bad(where, f"{where} must be a string or a list of text blocks")
    texts = []
    for position, block in enumerate(blocks):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            raise _bad(f"{where}[{position}]", f"{where}[{position}] must be a text block")
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def _string(block: Mapping[str, Any], name: str, where: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise _bad(f"{where}.{name}", f"{where}.{name} must be a string")
    return value


def _bad(param: str, message: str) -> RequestFieldError:
    return RequestFieldError(param, message + ".")
