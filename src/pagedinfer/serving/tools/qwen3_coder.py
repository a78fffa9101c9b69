"""Qwen3-Coder's XML tool calls (``--tool-call-parser qwen3_coder``, vLLM's name)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

One ``<tool_call>`` block per call (a bare ``<function=...>`` is read too, as vLLM does);
content is the text before the first call. A parameter's value is its raw text between the
tags, one leading and one trailing newline dropped; it ends at ``</parameter>``, or at the
next ``<parameter=`` or ``</function>`` when the closing tag is left out. A call is complete
at ``</function>`` (the last ``</tool_call>`` may be missing); a call cut short (``max_tokens``)
is malformed, and the whole answer is then content, as with the other parsers.

Values are converted by the type their function's ``parameters`` schema gives them (vLLM's
rules): ``"null"`` is null; ``string`` (or no schema) stays text; ``integer`` and ``number``
become numbers (a whole number as an integer), ``boolean`` ``true`` / ``false`` (anything
else false); ``object``, ``array`` and other types are read as JSON, then as a Python
literal, else kept as text. The arguments are the JSON object of the converted parameters,
built as each parameter completes (so a stream sends each parameter once it is whole).
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pagedinfer.serving.tools.formats import CallSoFar, Scan, ToolCallFormat
from pagedinfer.serving.tools.scan import held_back, skip_space

__all__ = ["Qwen3CoderFormat"]

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_JSON_TYPES = frozenset({"object", "array", "arr"})
_LITERAL_LIMIT = 100_000  # characters read as a Python literal at most


class Qwen3CoderFormat(ToolCallFormat):
    """``<tool_call><function=NAME><parameter=P>V</parameter>...</function></tool_call>``."""

    CALL = "<tool_call>"
    CALL_END = "</tool_call>"
    FUNCTION = "<function="
    FUNCTION_END = "</function>"
    PARAMETER = "<parameter="
    PARAMETER_END = "</parameter>"
    keeps_special_tokens = True  # the tags are special tokens in some checkpoints

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        # Each function's parameter schemas by name, for the values' types.
        self._properties: dict[str, Mapping[str, Any]] = {}
        # Members already converted (a stream reads the growing text again at every step).
        self._members: dict[tuple[str, str, str], str] = {}
        for tool in tools or ():
            function = tool.get("function")
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                continue
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
            self._properties[function["name"]] = (
                properties if isinstance(properties, Mapping) else {}
            )

    @classmethod
    def for_tools(cls, tools: Sequence[Mapping[str, Any]] | None) -> ToolCallFormat:
        return cls(tools)

    def scan(self, text: str, final: bool) -> Scan:
        index = self._next_call(text, 0)
        if index < 0:
            if final:
                return Scan(text)
            markers = (self.CALL, self.FUNCTION)
            return Scan(text[: len(text) - held_back(text, markers)].rstrip())
        content = text[:index].rstrip()
        calls: list[CallSoFar] = []
        while index >= 0:
            if text.startswith(self.CALL, index):
                index = skip_space(text, index + len(self.CALL))
            rest = text[index:]
            if not rest.startswith(self.FUNCTION):
                pending = not final and self.FUNCTION.startswith(rest)
                return Scan(content, tuple(calls), malformed=not pending)
            call, index, malformed = self._function(text, index + len(self.FUNCTION), final)
            if call is not None:
                calls.append(call)
            if malformed or call is None or not call.complete:
                return Scan(content, tuple(calls), malformed=malformed)
            after = skip_space(text, index)
            if text.startswith(self.CALL_END, after):
                after += len(self.CALL_END)
            index = self._next_call(text, after)
        return Scan(content, tuple(calls))

    def _next_call(self, text: str, start: int) -> int:
        """The index of the next call's first tag at or after ``start`` (-1: none)."""
        call = text.find(self.CALL, start)
        function = text.find(self.FUNCTION, start, len(text) if call < 0 else call)
        return function if function >= 0 else call

    def _function(self, text: str, index: int, final: bool) -> tuple[CallSoFar | None, int, bool]:
        """The call whose name starts at ``index``: the call so far (``None``: its name is
        not complete yet), the index after it, whether it is malformed."""
        close = text.find(">", index)
        if close < 0:
            partial = text[index:]
            return None, len(text), final or not _NAME.fullmatch(partial.strip() or "x")
        name = text[index:close].strip()
        if not _NAME.fullmatch(name):
            return None, close, True
        members: list[str] = []
        index = close + 1
        while True:
            index = skip_space(text, index)
            rest = text[index:]
            if rest.startswith(self.FUNCTION_END):
                arguments = "{" + ", ".join(members) + "}"
                return CallSoFar(name, arguments, True), index + len(self.FUNCTION_END), False
            if not rest.startswith(self.PARAMETER):
                pending = not final and any(
                    tag.startswith(rest) for tag in (self.FUNCTION_END, self.PARAMETER)
                )
                return CallSoFar(name, "{" + ", ".join(members), False), index, not pending
            start = index + len(self.PARAMETER)
            close = text.find(">", start)
            end = self._value_end(text, close + 1) if close >= 0 else -1
            if end < 0:  # the parameter goes on
                return CallSoFar(name, "{" + ", ".join(members), False), len(text), final
            members.append(self._member(name, text[start:close].strip(), text[close + 1 : end]))
            index = end + (
                len(self.PARAMETER_END) if text.startswith(self.PARAMETER_END, end) else 0
            )

    def _member(self, function: str, key: str, raw: str) -> str:
        """``"key": value`` of one complete parameter, its value converted by its type."""
        cache_key = (function, key, raw)
        member = self._members.get(cache_key)
        if member is None:
            value = _convert(_unwrap(raw), self._properties.get(function, {}).get(key))
            member = f"{json.dumps(key, ensure_ascii=False)}: {value}"
            self._members[cache_key] = member
        return member

    def _value_end(self, text: str, start: int) -> int:
        """Where the parameter value starting at ``start`` ends (-1: not yet). Each tag is
        looked for only before the nearest one found so far: a value costs its length."""
        end = -1
        for tag in (self.PARAMETER_END, self.PARAMETER, self.FUNCTION_END):
            found = text.find(tag, start, len(text) if end < 0 else end)
            if found >= 0:
                end = found
        return end


def _unwrap(value: str) -> str:
    """A value without the newline after its opening tag and before its closing tag."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _type(schema: Any) -> str:
    """The schema's type, lower-cased (the first that is not null of a list)."""
    if not isinstance(schema, Mapping):
        return "string"
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((item for item in kind if item != "null"), "string")
    if kind is None:
        return (
            "string" if "enum" in schema and all(isinstance(e, str) for e in schema["enum"]) else ""
        )
    return str(kind).strip().lower()


def _convert(value: str, schema: Any) -> str:
    """The JSON text of a parameter's value, converted by its schema's type."""
    if value.lower() == "null":
        return "null"
    kind = _type(schema)
    if kind in _STRING_TYPES:
        return json.dumps(value, ensure_ascii=False)
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return json.dumps(int(value.strip()))
        except ValueError:
            return json.dumps(value, ensure_ascii=False)
    if kind.startswith(("num", "float")):
        try:
            number = float(value.strip())
        except ValueError:
            return json.dumps(value, ensure_ascii=False)
        if not math.isfinite(number):
            return json.dumps(value, ensure_ascii=False)
        return json.dumps(int(number) if number.is_integer() else number)
    if kind in ("boolean", "bool", "binary"):
        return "true" if value.strip().lower() == "true" else "false"
    return _structured(value)


def _structured(value: str) -> str:
    """An object, array or other value: as JSON, else as a Python literal, else text."""
    try:
        return json.dumps(json.loads(value), ensure_ascii=False)
    except (ValueError, RecursionError):
        pass
    if len(value) <= _LITERAL_LIMIT:
        try:
            return json.dumps(ast.literal_eval(value.strip()), ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    return json.dumps(value, ensure_ascii=False)
