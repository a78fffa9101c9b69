"""The body of ``POST /v1/responses`` (OpenAI's Responses API) and its translation into the
chat request the server already serves.

A Responses request is a chat in another shape: ``instructions`` become the system message,
``input`` (a string, or a list of messages and items) the conversation, ``max_output_tokens``
the ``max_completion_tokens``, the flat function ``tools`` (``{"type": "function", "name",
"parameters"}``) and ``tool_choice`` their chat forms, ``text.format`` the
``response_format`` and ``reasoning.effort`` the ``reasoning_effort``.
:func:`chat_request` builds that :class:`~pagedinfer.serving.protocol.ChatCompletionRequest`,
so both routes check, render, sample and read tool calls the same way.

Input items: messages (``{"role", "content"}``, ``"type": "message"`` optional; roles
``user``, ``assistant``, ``system`` and ``developer``, which templates read as ``system``;
content a string or ``input_text`` / ``output_text`` parts), ``function_call`` (an assistant
turn's call: ``call_id``, ``name``, ``arguments``), ``function_call_output`` (the tool's
answer: ``call_id``, ``output``) and ``reasoning`` (its text reaches the template as the
next assistant turn's ``reasoning_content``). Anything else is a 400 naming the item.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedinfer.serving.fields import RESPONSES, FieldPolicy, RequestFieldError
from pagedinfer.serving.protocol import (
    MAX_REQUEST_ID_LENGTH,
    Bias,
    ChatCompletionRequest,
    Float32,
    Int64,
    ReasoningEffort,
)

__all__ = [
    "ResponsesRequest",
    "chat_request",
    "check_response_fields",
    "conversation",
]

# Roles of input messages, as the chat template gets them.
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# vLLM's sampling extensions a Responses request may carry, passed to the chat request as
# they are.
_SAMPLING_EXTRAS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logit_bias",
    "stop",
    "skip_special_tokens",
    "chat_template_kwargs",
)


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: OpenAI's fields the server serves, then vLLM's extensions.
    Other fields land in ``model_extra`` for :func:`check_response_fields`."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: Float32 | None = None
    top_p: Float32 | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    # vLLM's extensions.
    top_k: Int64 | None = None
    min_p: Float32 | None = None
    repetition_penalty: Float32 | None = None
    presence_penalty: Float32 | None = None
    frequency_penalty: Float32 | None = None
    seed: Int64 | None = None
    logit_bias: dict[str, Bias] | None = None
    stop: str | list[str] | None = None
    skip_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID_LENGTH)] | None = None


def check_response_fields(request: ResponsesRequest, policy: FieldPolicy) -> None:
    """Refuse what the server cannot serve (a 400 naming the field), warn about the ignored
    fields; ``stream_options`` needs ``stream: true``."""
    policy.check(RESPONSES, request.model_extra)
    options = request.stream_options
    if options is not None:
        policy.check(RESPONSES, options, prefix="stream_options.")
        if not request.stream:
            raise _bad("stream_options", "stream_options can only be given with stream=true")
    reasoning = request.reasoning
    if reasoning is not None:
        for name, value in reasoning.items():
            if name == "effort":
                continue
            if name in ("summary", "generate_summary") and value is None:
                continue
            raise _bad(
                f"reasoning.{name}",
                f"reasoning.{name} is not supported: the reasoning items carry the model's "
                "whole reasoning text (no summaries). Send only reasoning.effort",
            )


def chat_request(
    request: ResponsesRequest, history: Sequence[Mapping[str, Any]] = ()
) -> ChatCompletionRequest:
    """The chat request that answers ``request``; ``history``: the conversation of its
    ``previous_response_id`` (the previous instructions are not carried over, as OpenAI's
    API does)."""
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": conversation(request, history),
        "max_completion_tokens": request.max_output_tokens,
        "stream": request.stream,
    }
    for name in ("temperature", "top_p", "parallel_tool_calls", "request_id", *_SAMPLING_EXTRAS):
        value = getattr(request, name)
        if value is not None:
            fields[name] = value
    if request.tools:
        fields["tools"] = chat_tools(request.tools)
    if request.tool_choice is not None:
        fields["tool_choice"] = _chat_tool_choice(request.tool_choice)
    response_format = _response_format(request.text)
    if response_format is not None:
        fields["response_format"] = response_format
    effort = (request.reasoning or {}).get("effort")
    if effort is not None:
        fields["reasoning_effort"] = _effort(effort)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:  # a field of the request the chat cannot take
        raise RequestValidationError(error.errors()) from None


def conversation(
    request: ResponsesRequest, history: Sequence[Mapping[str, Any]] = ()
) -> list[dict[str, Any]]:
    """The chat messages of ``request``: its instructions, ``history``, then its input."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    messages.extend(dict(message) for message in history)
    messages.extend(input_messages(request.input))
    if not messages:
        raise _bad("input", "input is empty: send a string or at least one message")
    return messages


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (function calls join the assistant turn before them)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item's text, for the next assistant turn
    for index, item in enumerate(value):
        where = f"input[{index}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise _bad(
                    f"{where}.role",
                    f"{where}.role={item.get('role')!r} is not supported: expected user, "
                    "assistant, system or developer",
                )
            message: dict[str, Any] = {"role": role, "content": _text(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or reasoning is not None:
                last = {"role": "assistant", "content": ""}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _text(output, f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        else:
            raise _bad(
                f"{where}.type",
                f"{where}.type={kind!r} is not supported: input items are messages, "
                "function_call, function_call_output and reasoning",
            )
    return messages


def chat_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """The flat function tools in their chat form (a 400 naming any other tool)."""
    chat: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, Mapping):
            raise _bad(where, f'{where} must be an object {{"type": "function", "name": ...}}')
        kind = tool.get("type")
        if kind != "function":
            raise _bad(
                f"{where}.type",
                f"{where}.type={kind!r} is not supported: this server has no built-in tools; "
                'only function tools ({"type": "function", "name", "parameters"}) are',
            )
        function = {
            name: tool[name]
            for name in ("name", "description", "parameters", "strict")
            if tool.get(name) is not None
        }
        chat.append({"type": "function", "function": function})
    return chat


def _chat_tool_choice(value: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(value, str):
        return value
    if value.get("type") == "function" and "function" not in value:
        return {"type": "function", "function": {"name": value.get("name")}}
    if value.get("type") == "allowed_tools":
        raise _bad("tool_choice", "tool_choice of type allowed_tools is not supported")
    return value


def _response_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    if text is None:
        return None
    for name in text:
        if name not in ("format", "verbosity"):
            raise _bad(f"text.{name}", f"text.{name} is not supported: send text.format")
    if text.get("verbosity") not in (None, "medium"):
        raise _bad("text.verbosity", "text.verbosity is not supported (verbosity hints)")
    spec = text.get("format")
    if spec is None:
        return None
    if not isinstance(spec, Mapping):
        raise _bad("text.format", "text.format must be an object")
    kind = spec.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {
            name: spec[name]
            for name in ("name", "schema", "description", "strict")
            if spec.get(name) is not None
        }
        return {"type": "json_schema", "json_schema": schema}
    raise _bad(
        "text.format.type",
        f"text.format.type={kind!r} is not supported: expected text, json_object or json_schema",
    )


def _effort(value: Any) -> ReasoningEffort:
    allowed = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
    if value not in allowed:
        raise _bad(
            "reasoning.effort",
            f"reasoning.effort={value!r} is not supported: expected one of {', '.join(allowed)}",
        )
    effort: ReasoningEffort = value
    return effort


def _text(content: Any, where: str) -> str:
    """A message's content (or a tool's output): a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"{where}.content must be a string or a list of input_text parts")
    texts = []
    for position, part in enumerate(content):
        if (
            not isinstance(part, Mapping)
            or part.get("type") not in _TEXT_PARTS
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, Mapping) else None
            raise _bad(
                f"{where}.content[{position}]",
                f"{where}.content[{position}] of type {kind!r} is not supported: this server "
                "serves text-only models (input_text and output_text parts)",
            )
        texts.append(part["text"])
    return "".join(texts)


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise _bad(f"{where}.content", f"{where}.content must be a list of reasoning_text parts")
    texts = [part.get("text") for part in parts if isinstance(part, Mapping)]
    return "".join(text for text in texts if isinstance(text, str))


def _string(item: Mapping[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise _bad(f"{where}.{name}", f"{where}.{name} must be a string")
    return value


def _bad(param: str, message: str) -> RequestFieldError:
    return RequestFieldError(param, message + ".")
