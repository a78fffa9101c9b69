"""What a chat request's ``tools`` and ``tool_choice`` ask of the server (vLLM's rules).

* ``tools``: OpenAI's function tools ``{"type": "function", "function": {"name",
  "description", "parameters", "strict"}}``. They reach the chat template as ``tools`` (HF
  chat templates render them into the prompt), whatever ``tool_choice`` is.
* ``tool_choice``: ``"none"`` (the answer is text), ``"auto"`` (the model decides; the
  server reads calls out of the text with the ``--tool-call-parser``, which needs
  ``--enable-auto-tool-choice``: a 400 otherwise, as vLLM answers), ``"required"`` (one call
  or more, decoded under a JSON schema of an array of ``{"name", "parameters"}``, so the
  calls always parse and their arguments match their function's ``parameters``), or a named
  function ``{"type": "function", "function": {"name": ...}}`` (the answer is its arguments,
  decoded under its ``parameters`` schema). Left out: ``"auto"`` with tools, else
  ``"none"``.
* ``parallel_tool_calls: false``: at most one call (``"required"``: the schema allows one;
  ``"auto"``: the first call is kept, as vLLM does).

The answer's ``finish_reason`` is ``"tool_calls"`` when ``"auto"`` found calls, or when
``"required"`` ended on its own (``"stop"``); a named function keeps the engine's (``"stop"``),
as OpenAI and vLLM answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pagedinfer.domain.structured import StructuredOutputsParams
from pagedinfer.errors import InvalidStructuredOutputError
from pagedinfer.serving.fields import RequestFieldError
from pagedinfer.serving.tools.formats import (
    Extracted,
    NamedCallFormat,
    RequiredCallsFormat,
    ToolCallFormat,
)
from pagedinfer.serving.tools.parsers import tool_call_format
from pagedinfer.serving.tools.schemas import (
    ToolSchemaError,
    check_tool_depth,
    check_tool_references,
    embed_tool_parameters,
)
from pagedinfer.serving.tools.stream import ToolCallStream

__all__ = [
    "TOOL_CALL_WHITESPACE",
    "ToolCalls",
    "ToolPlan",
    "plan_tools",
    "template_messages",
    "template_tools",
]

# Tool calls decoded under a schema ("required", a named function) have at most one space
# between JSON tokens: the one-line JSON models write, and no runaway whitespace.
TOOL_CALL_WHITESPACE = " ?"
# OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

Finish = Literal["auto", "required", "named"]
_R = TypeVar("_R")


@dataclass(frozen=True, slots=True)
class ToolCalls:
    """How the answer's tool calls are read and reported."""

    format: ToolCallFormat
    finish: Finish
    parallel: bool = True
    # Texts stripped from the answer's end (EOS, decoded when special tokens are kept).
    end_texts: tuple[str, ...] = ()

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.format, parallel=self.parallel, end_texts=self.end_texts)

    def extract(self, text: str) -> Extracted:
        """The content and calls of a finished answer."""
        extracted = self.format.extract(_strip_end(text, self.end_texts))
        if not self.parallel and len(extracted.calls) > 1:
            return Extracted(extracted.content, extracted.calls[:1])
        return extracted

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """The answer's ``finish_reason``, from the engine's and whether calls were made."""
        if reason is None or not called or self.finish == "named":
            return reason
        if self.finish == "required" and reason != "stop":
            return reason
        return "tool_calls"


def _strip_end(text: str, end_texts: tuple[str, ...]) -> str:
    for end in end_texts:
        if end and text.endswith(end):
            return text[: -len(end)]
    return text


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A chat request's tools: what the template gets, the constraint the answer is decoded
    under (``"required"``, a named function), how calls are read (``None``: the answer is
    text), and whether the answer must keep special tokens (its parser's markers)."""

    tools: list[dict[str, Any]] | None = None
    constraint: StructuredOutputsParams | None = None
    calls: ToolCalls | None = None
    keeps_special_tokens: bool = False


def template_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """The request's ``tools`` checked (a 400 naming the bad one) and as the chat template
    gets them; ``None`` for no tools (left out, ``null`` or ``[]``)."""
    if not tools:
        return None
    checked: list[dict[str, Any]] = []
    names: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, Mapping):
            raise _bad(where, f"{where} must be an object {{'type': 'function', 'function': ...}}")
        if tool.get("type", "function") != "function":
            raise _bad(
                f"{where}.type",
                f"{where}.type={tool.get('type')!r} is not supported: only function tools "
                "({'type': 'function', 'function': {...}}) are",
            )
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise _bad(f"{where}.function", f"{where}.function must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(
                f"{where}.function.name",
                f"{where}.function.name={name!r} is invalid: expected 1 to 64 letters, digits, "
                "'_', '.' or '-'",
            )
        if name in names:
            raise _bad(f"{where}.function.name", f"two tools are named {name!r}: name each once")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise _bad(
                f"{where}.function.parameters",
                f"{where}.function.parameters must be a JSON schema object",
            )
        _checked(check_tool_depth, parameters, f"{where}.function.parameters")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            where = f"{where}.function.description"
            raise _bad(where, f"{where} must be a string")
        checked.append({**tool, "type": "function", "function": dict(function)})
    return checked


def plan_tools(
    tools: Sequence[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    *,
    parser: str | None,
    auto_tool_choice: bool,
    end_texts: tuple[str, ...] = (),
) -> ToolPlan:
    """What ``tools`` and ``tool_choice`` ask for (400s naming the field for what cannot be
    served). ``parser``: the server's ``--tool-call-parser``; ``auto_tool_choice``: its
    ``--enable-auto-tool-choice``; ``end_texts``: EOS texts, stripped from an answer decoded
    with its special tokens."""
    checked = template_tools(tools)
    choice = _tool_choice(tool_choice, checked)
    parallel = parallel_tool_calls is not False
    if checked is None or choice == "none":
        return ToolPlan(tools=checked)
    if choice == "auto":
        if not auto_tool_choice or parser is None:
            raise _bad(
                "tool_choice",
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                'to be set on the server (send tool_choice "required", a named function or '
                '"none", or ask the operator to enable them)',
            )
        format = tool_call_format(parser, checked)
        keeps = format.keeps_special_tokens
        calls = ToolCalls(format, "auto", parallel, end_texts if keeps else ())
        return ToolPlan(tools=checked, calls=calls, keeps_special_tokens=keeps)
    if choice == "required":
        schema = _required_schema(checked, parallel)
        constraint = _constraint(schema, "tools")  # names the tool when it is its schema
        calls = ToolCalls(RequiredCallsFormat(), "required", parallel)
        return ToolPlan(tools=checked, constraint=constraint, calls=calls)
    index = next(i for i, t in enumerate(checked) if t["function"]["name"] == choice)
    schema = dict(checked[index]["function"].get("parameters") or _EMPTY_PARAMETERS)
    field = f"tools[{index}].function.parameters"
    _checked(check_tool_references, schema, field)
    constraint = _constraint(schema, field)
    return ToolPlan(
        tools=checked, constraint=constraint, calls=ToolCalls(NamedCallFormat(choice), "named")
    )


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str:
    """``"none"``, ``"auto"``, ``"required"`` or the named function's name."""
    if value is None:
        return "auto" if tools else "none"
    if value in ("none", "auto"):
        return str(value)
    usage = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    name: str | None
    if value == "required":
        name = None
    elif isinstance(value, Mapping) and value.get("type", "function") == "function":
        function = value.get("function")
        named = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(named, str) or not named:
            raise _bad("tool_choice", f"tool_choice={value!r} names no function: expected {usage}")
        name = named
    else:
        raise _bad("tool_choice", f"tool_choice={value!r} is not supported: expected {usage}")
    if tools is None:
        raise _bad("tool_choice", f"tool_choice={value!r} needs tools: send the tools too")
    if name is None:
        return "required"
    if not any(t["function"]["name"] == name for t in tools):
        known = ", ".join(repr(t["function"]["name"]) for t in tools)
        raise _bad(
            "tool_choice",
            f"tool_choice names the function {name!r}, which is not among the tools ({known})",
        )
    return name


def _required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice="required"``: an array of one call or more (one at
    most without ``parallel_tool_calls``), each ``{"name": <a tool's name>, "parameters":
    <that tool's parameters>}`` and nothing else (vLLM's leaves other members open, and a
    model may then write one that never ends). A tool whose parameters hold ``$ref``s goes to
    the root's ``$defs`` under its name, its ``$ref``s rewritten to resolve there as they did
    in the tool's own schema (:mod:`~pagedinfer.serving.tools.schemas`)."""
    variants = []
    defs: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        function = tool["function"]
        name = function["name"]
        parameters = function.get("parameters") or _EMPTY_PARAMETERS
        field = f"tools[{index}].function.parameters"
        embedded = _checked(embed_tool_parameters, parameters, field, name)
        if embedded.definition is not None:
            defs[name] = embedded.definition
        variants.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": embedded.schema,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": variants},
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _checked(check: Callable[..., _R], *args: Any) -> _R:
    """``check(*args)``, its :class:`ToolSchemaError` a 400 naming the tool's parameters."""
    try:
        return check(*args)
    except ToolSchemaError as error:
        raise _bad(error.field, str(error)) from None


def _constraint(schema: dict[str, Any], field: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema, whitespace_pattern=TOOL_CALL_WHITESPACE)
    except InvalidStructuredOutputError as error:
        raise _bad(field, f"{field}: {error}") from None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with each assistant message's ``tool_calls[].function.arguments``
    (a JSON string in OpenAI's format) parsed into an object, as HF chat templates expect
    them (vLLM does the same); a 400 naming the message for arguments that are no JSON."""
    for index, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not calls:
            continue
        if not isinstance(calls, list):
            raise _bad(f"messages[{index}].tool_calls", "tool_calls must be a list of calls")
        parsed = []
        for position, call in enumerate(calls):
            where = f"messages[{index}].tool_calls[{position}]"
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping):
                raise _bad(where, f"{where} must be {{'id', 'type': 'function', 'function'}}")
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments.strip():
                try:
                    arguments = json.loads(arguments)
                except ValueError as error:
                    raise _bad(
                        f"{where}.function.arguments",
                        f"{where}.function.arguments is not JSON ({error}): send the "
                        "arguments the call was made with (a JSON object as a string)",
                    ) from None
            elif not arguments:
                arguments = {}
            parsed.append({**call, "function": {**function, "arguments": arguments}})
        messages[index] = {**message, "tool_calls": parsed}
    return messages


def _bad(param: str, message: str) -> RequestFieldError:
    return RequestFieldError(param, message + ".")
