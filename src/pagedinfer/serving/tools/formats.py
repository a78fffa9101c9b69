"""How each model family writes tool calls, read from its generated text.

A format turns text into a :class:`Scan`: the answer's content and the calls so far. It is a
pure function of the text, and it only ever grows as the text grows (text that could still
turn into a call marker or belong to a call is held back), so a stream can send each scan's
new part as a delta (:mod:`pagedinfer.serving.tools.stream`) and the pieces add up to the
scan of the whole text. :meth:`ToolCallFormat.extract` reads a finished answer: its calls,
or (when any call is malformed) the whole text as content and no call, as vLLM's parsers
answer.

A call's ``arguments`` are the model's own JSON text of the arguments object, verbatim
(vLLM re-serializes them with ``json.dumps``; keeping them lets a stream send the arguments
as they are generated and still add up to the whole answer's). They must be a JSON object.

Families (``--tool-call-parser NAME``, vLLM's names; the registry is
:mod:`~pagedinfer.serving.tools.parsers`, ``qwen3_coder``'s XML format is
:mod:`~pagedinfer.serving.tools.qwen3_coder`):

* ``hermes`` (Hermes 2/3, Qwen2.5, Qwen3, QwQ): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one block per call; content is the text before the first block. Some
  Hermes checkpoints make the tags special tokens, so the answer is decoded with them (as
  vLLM's parser asks).
* ``llama3_json`` / ``llama4_json`` (Llama 3.1, 3.2, 3.3, 4 JSON tool calling): the answer
  is ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), several separated by
  ``;``, optionally after ``<|python_tag|>``; anything else is content.
* ``mistral`` (Mistral 7B v0.3, Mistral Small / Nemo / Large ...): ``[TOOL_CALLS]`` then a
  JSON array of ``{"name": ..., "arguments": {...}}``, or (tokenizers v11 and later)
  ``[TOOL_CALLS]name[ARGS]{...}`` per call; content is the text before the marker. The
  markers are special tokens, so the answer is decoded with them; tool call ids are 9
  letters and digits, as Mistral's templates require.

An answer decoded with its special tokens (``skip_special_tokens`` off unless the request sets
it) ends with the EOS token's text, which the server leaves out.

Two more formats are the server's own, for answers decoded under a constraint:
``tool_choice="required"`` (a JSON array of ``{"name": ..., "parameters": {...}}``, vLLM's)
and a named function (the answer is its arguments object).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pagedinfer.serving.tools.scan import ObjectScan, held_back, scan_object, skip_space

__all__ = [
    "CallSoFar",
    "Extracted",
    "HermesFormat",
    "Llama3JsonFormat",
    "MistralFormat",
    "NamedCallFormat",
    "ParsedCall",
    "RequiredCallsFormat",
    "Scan",
    "ToolCallFormat",
]


@dataclass(frozen=True, slots=True)
class CallSoFar:
    """A call as far as the text goes: its name once the name string is complete, the text
    of its arguments object so far, whether the call is closed."""

    name: str | None
    arguments: str
    complete: bool


@dataclass(frozen=True, slots=True)
class Scan:
    """What a text holds so far: the content to show, the calls, and whether the text has
    turned out not to follow the format."""

    content: str
    calls: tuple[CallSoFar, ...] = ()
    malformed: bool = False


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call of a finished answer."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Extracted:
    """A finished answer: its content (``None`` when it has calls and no text) and calls."""

    content: str | None
    calls: tuple[ParsedCall, ...] = ()


class ToolCallFormat(ABC):
    """A family's way of writing tool calls (see the module docstring)."""

    # Whether the answer must be decoded with special tokens kept (its markers are some).
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """The content and calls of ``text``; ``final``: no more text follows."""

    def extract(self, text: str) -> Extracted:
        """The content and calls of a finished answer; the text as content and no call when
        a call is malformed (a call needs a name and a JSON object of arguments)."""
        scan = self.scan(text, final=True)
        if scan.malformed or not scan.calls:
            return Extracted(text)
        calls = []
        for call in scan.calls:
            if call.name is None or not call.complete or not _is_object(call.arguments):
                return Extracted(text)
            calls.append(ParsedCall(call.name, call.arguments))
        return Extracted(scan.content or None, tuple(calls))

    def new_id(self) -> str:
        """A tool call id (OpenAI's form)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    @classmethod
    def for_tools(cls, tools: Sequence[Mapping[str, Any]] | None) -> ToolCallFormat:
        """The format for a request's ``tools`` (most formats do not need them)."""
        del tools
        return cls()


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _call(text: str, found: ObjectScan, argument_keys: tuple[str, ...]) -> CallSoFar | None:
    """The call an object describes so far; None if it cannot be one (a name that is no
    string, arguments that are no object)."""
    name = None
    member = found.member("name")
    if member is not None and member.end is not None:
        value = member.value(text)
        if not isinstance(value, str) or not value:
            return None
        name = value
    arguments = ""
    member = found.member(*argument_keys)
    if member is not None and member.start < len(text):
        if text[member.start] != "{":
            return None
        arguments = member.raw(text)
    complete = found.end is not None
    if complete and member is None:
        arguments = "{}"  # a call without arguments
    return CallSoFar(name, arguments, complete)


def _content_before(text: str, marker: str, final: bool) -> tuple[str, int]:
    """The content before the first ``marker`` and the marker's index (-1: none yet). While
    the text may go on, a tail that could start the marker, and trailing whitespace (which
    is dropped before a call), are held back."""
    first = text.find(marker)
    if first >= 0:
        return text[:first].rstrip(), first
    if final:
        return text, -1
    return text[: len(text) - held_back(text, (marker,))].rstrip(), -1


def _objects(
    text: str,
    index: int,
    final: bool,
    argument_keys: tuple[str, ...],
    separators: str,
    closing: str,
) -> tuple[list[CallSoFar], bool, int]:
    """Calls written as JSON objects from ``index`` on, separated by one of ``separators``
    (whitespace around them allowed) and ended by ``closing`` (or the end of the text when
    ``closing`` is empty). Returns the calls, whether the text is malformed, and the index
    after the last one (and its closing)."""
    calls: list[CallSoFar] = []
    while True:
        index = skip_space(text, index)
        if index >= len(text):
            return calls, final and (not calls or bool(closing)), index
        if text[index] != "{":
            return calls, True, index
        found = scan_object(text, index)
        call = None if found.error else _call(text, found, argument_keys)
        if call is None:
            return calls, True, index
        calls.append(call)
        if found.end is None:
            return calls, final, len(text)
        index = skip_space(text, found.end)
        if index >= len(text):
            return calls, final and bool(closing), index
        if text[index] in separators:
            index += 1
            continue
        if closing and text[index] == closing:
            return calls, False, index + 1
        return calls, True, index


class HermesFormat(ToolCallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5,
    Qwen3)."""

    START = "<tool_call>"
    END = "</tool_call>"
    keeps_special_tokens = True  # some Hermes checkpoints make the tags special (vLLM's rule)

    def scan(self, text: str, final: bool) -> Scan:
        content, index = _content_before(text, self.START, final)
        if index < 0:
            return Scan(content)
        calls: list[CallSoFar] = []
        while index >= 0:
            index = skip_space(text, index + len(self.START))
            if index >= len(text):
                return Scan(content, tuple(calls), malformed=final)
            if text[index] != "{":
                return Scan(content, tuple(calls), malformed=True)
            found = scan_object(text, index)
            call = None if found.error else _call(text, found, ("arguments", "parameters"))
            if call is None:
                return Scan(content, tuple(calls), malformed=True)
            calls.append(call)
            if found.end is None:
                return Scan(content, tuple(calls), malformed=final)
            after = skip_space(text, found.end)
            rest = text[after : after + len(self.END)]
            if rest == self.END:
                after += len(self.END)
            elif not self.END.startswith(rest):  # the last block may lack its end tag
                return Scan(content, tuple(calls), malformed=True)
            index = text.find(self.START, after)
        return Scan(content, tuple(calls))


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.x / 4 JSON tool calls: the answer is ``{"name": ..., "parameters": {...}}``
    (several separated by ``;``), optionally after ``<|python_tag|>``."""

    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        index = skip_space(text, 0)
        rest = text[index:]
        if rest.startswith(self.TAG):
            index += len(self.TAG)
        elif not final and (not rest or self.TAG.startswith(rest)):
            return Scan("")  # the call marker may be coming
        elif not rest.startswith("{"):
            return Scan(text)
        calls, malformed, _ = _objects(
            text, index, final, ("parameters", "arguments"), separators=";", closing=""
        )
        return Scan("", tuple(calls), malformed=malformed)


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ID_ALPHABET = string.ascii_letters + string.digits


class MistralFormat(ToolCallFormat):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or (tokenizers v11+)
    ``[TOOL_CALLS]name[ARGS]{...}`` per call."""

    TAG = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        content, index = _content_before(text, self.TAG, final)
        if index < 0:
            return Scan(content)
        start = skip_space(text, index + len(self.TAG))
        if start >= len(text):
            return Scan(content, (), malformed=final)
        if text[start] == "[":
            calls, malformed, _ = _objects(
                text, start + 1, final, ("arguments",), separators=",", closing="]"
            )
            return Scan(content, tuple(calls), malformed=malformed)
        return self._named_calls(text, index, content, final)

    def _named_calls(self, text: str, index: int, content: str, final: bool) -> Scan:
        calls: list[CallSoFar] = []
        while index >= 0:
            index += len(self.TAG)
            args = text.find(self.ARGS, index)
            if args < 0:
                head = text[index:]
                head = head[: len(head) - held_back(head, (self.ARGS, self.CALL_ID))]
                pending = head.split(self.CALL_ID)[0].strip()
                if final or (pending and not _MISTRAL_NAME.fullmatch(pending)):
                    return Scan(content, tuple(calls), malformed=True)
                return Scan(content, tuple(calls))
            name = text[index:args].split(self.CALL_ID)[0].strip()
            if not _MISTRAL_NAME.fullmatch(name):
                return Scan(content, tuple(calls), malformed=True)
            start = skip_space(text, args + len(self.ARGS))
            if start >= len(text):
                calls.append(CallSoFar(name, "", False))
                return Scan(content, tuple(calls), malformed=final)
            if text[start] != "{":
                return Scan(content, tuple(calls), malformed=True)
            found = scan_object(text, start)
            if found.error:
                return Scan(content, tuple(calls), malformed=True)
            end = len(text) if found.end is None else found.end
            calls.append(CallSoFar(name, text[start:end], found.end is not None))
            if found.end is None:
                return Scan(content, tuple(calls), malformed=final)
            index = text.find(self.TAG, found.end)
        return Scan(content, tuple(calls))

    def new_id(self) -> str:
        """Mistral's templates take ids of exactly 9 letters and digits."""
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


class RequiredCallsFormat(ToolCallFormat):
    """``tool_choice="required"``: the answer is decoded under a JSON schema of an array of
    ``{"name": ..., "parameters": {...}}`` (vLLM's), so it is the calls and nothing else."""

    def scan(self, text: str, final: bool) -> Scan:
        index = skip_space(text, 0)
        if index >= len(text):
            return Scan("", (), malformed=final)
        if text[index] != "[":
            return Scan("", (), malformed=True)
        calls, malformed, _ = _objects(
            text, index + 1, final, ("parameters",), separators=",", closing="]"
        )
        return Scan("", tuple(calls), malformed=malformed)


class NamedCallFormat(ToolCallFormat):
    """A named function (``tool_choice={"type": "function", "function": {"name": ...}}``):
    the answer, decoded under the function's parameter schema, is its arguments. As in vLLM
    it is always the call, even when cut short by ``max_tokens``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def scan(self, text: str, final: bool) -> Scan:
        return Scan("", (CallSoFar(self.name, text.lstrip(), final),))

    def extract(self, text: str) -> Extracted:
        return Extracted(None, (ParsedCall(self.name, text.lstrip()),))
