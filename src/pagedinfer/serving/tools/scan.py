"""Scanning JSON that is still being generated: where an object's members start and end.

A tool call arrives token by token. To stream it, the server needs to know, in text that may
stop anywhere, which characters belong to a call's ``"arguments"`` object (they can be sent
at once: nothing that follows changes them) and when its ``"name"`` string is complete. Full
validation is left to :func:`json.loads` once the call is closed; the scanner only follows
strings (and their escapes) and bracket depth, and checks the object's own punctuation
(keys, colons, commas) so that text that is no JSON object is noticed early.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Member", "ObjectScan", "held_back", "scan_object", "skip_space"]

_SPACE = " \t\r\n"
# Characters of a number or a literal (true, false, null).
_SCALAR = frozenset("-+.0123456789eEtruefalsn")


@dataclass(frozen=True, slots=True)
class Member:
    """One member of an object: its key and where its value lies (``end``: the index after
    the value's last character, ``None`` while the value may still grow)."""

    key: str
    start: int
    end: int | None

    def raw(self, text: str) -> str:
        """The value's text so far."""
        return text[self.start : len(text) if self.end is None else self.end]

    def value(self, text: str) -> Any:
        """The decoded value of a complete member (``None`` when incomplete or invalid)."""
        if self.end is None:
            return None
        try:
            return json.loads(text[self.start : self.end])
        except ValueError:
            return None


@dataclass(frozen=True, slots=True)
class ObjectScan:
    """The members of an object read so far; ``end`` is the index after its closing brace
    (``None`` while open); ``error`` is set when the text cannot continue a JSON object."""

    members: tuple[Member, ...]
    end: int | None
    error: bool = False

    def member(self, *keys: str) -> Member | None:
        """The first member named by one of ``keys``."""
        for member in self.members:
            if member.key in keys:
                return member
        return None


def skip_space(text: str, index: int) -> int:
    """The index of the first non-whitespace character at or after ``index``."""
    while index < len(text) and text[index] in _SPACE:
        index += 1
    return index


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could be the start of one of ``markers``
    (they are held back from a stream until the next characters tell)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def _string_end(text: str, index: int) -> int | None:
    """The index after the string that opens at ``index`` (a quote), or None if unclosed."""
    index += 1
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == '"':
            return index + 1
        index += 1
    return None


# _value_end's answer when no JSON value starts at the index.
_INVALID = -1


def _value_end(text: str, index: int) -> int | None:
    """The index after the value that starts at ``index``; None if it may still grow;
    ``_INVALID`` if no JSON value starts there."""
    char = text[index]
    if char == '"':
        return _string_end(text, index)
    if char in "{[":
        depth = 0
        while index < len(text):
            char = text[index]
            if char == '"':
                end = _string_end(text, index)
                if end is None:
                    return None
                index = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return index + 1
            index += 1
        return None
    if char not in _SCALAR:
        return _INVALID
    while index < len(text) and text[index] in _SCALAR:
        index += 1
    return index if index < len(text) else None


def scan_object(text: str, start: int) -> ObjectScan:
    """Read the object that opens at ``text[start]`` (a ``{``) as far as ``text`` goes."""
    assert text[start] == "{"
    members: list[Member] = []
    index = skip_space(text, start + 1)
    expect_key = True
    first = True
    while index < len(text):
        char = text[index]
        if expect_key:
            if char == "}" and first:
                return ObjectScan(tuple(members), index + 1)
            if char != '"':
                return ObjectScan(tuple(members), None, error=True)
            key_end = _string_end(text, index)
            if key_end is None:
                break
            try:
                key = json.loads(text[index:key_end])
            except ValueError:
                return ObjectScan(tuple(members), None, error=True)
            index = skip_space(text, key_end)
            if index >= len(text):
                break
            if text[index] != ":":
                return ObjectScan(tuple(members), None, error=True)
            index = skip_space(text, index + 1)
            if index >= len(text):
                members.append(Member(key, index, None))
                break
            end = _value_end(text, index)
            if end == _INVALID:
                return ObjectScan(tuple(members), None, error=True)
            members.append(Member(key, index, end))
            if end is None:
                break
            index = skip_space(text, end)
            expect_key = False
            first = False
            continue
        if char == ",":
            index = skip_space(text, index + 1)
            expect_key = True
            continue
        if char == "}":
            return ObjectScan(tuple(members), index + 1)
        return ObjectScan(tuple(members), None, error=True)
    return ObjectScan(tuple(members), None)
