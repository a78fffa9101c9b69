"""A tool's ``parameters`` schema checked, and made to keep its meaning inside the server's.

With ``tool_choice="required"`` the server decodes under its own schema, an array of
``{"name", "parameters"}`` calls, and each tool's ``parameters`` sit inside it. A ``$ref``
is resolved against the schema it is written in: ``"$ref": "#"`` in a tool's parameters
means that tool's parameters, but inside the server's schema ``#`` is the array of calls.
So each tool whose parameters hold a ``$ref`` is moved to ``$defs/<tool name>`` of the
server's schema and every ``$ref`` in it is rewritten to point there: ``#`` becomes
``#/$defs/<name>``, ``#/properties/x`` becomes ``#/$defs/<name>/properties/x``,
``#/$defs/City`` becomes ``#/$defs/<name>/$defs/City`` (two tools may then define ``$defs``
of the same name differently).

What cannot be rewritten safely is a 400 naming the tool (with ``tool_choice`` required or a
named function, where the schema is compiled): a ``$ref`` that is not a JSON pointer into
the tool's own parameters (``http:``, ``file:``, relative URLs, ``#anchor``), a pointer to
nothing there, ``$anchor`` / ``$dynamicRef`` / ``$dynamicAnchor`` (and draft 2019's
``$recursiveRef`` / ``$recursiveAnchor``), and an ``$id`` below the root (it would change
what the ``$ref``s under it mean). A root ``$id`` and ``$schema`` are dropped from the
embedded copy. Every tool's parameters may nest at most :data:`MAX_TOOL_SCHEMA_DEPTH` levels
(whatever ``tool_choice``: they also reach the chat template).

Only schema positions are walked (``properties``, ``items``, ``anyOf`` ...): a ``"$ref"``
inside ``enum``, ``const``, ``default`` or ``examples`` is data and stays as it is. Every walk
is iterative: a deep schema cannot exhaust Python's stack. Pure Python.
"""

from __future__ import annotations

import copy
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_TOOL_SCHEMA_DEPTH",
    "EmbeddedParameters",
    "ToolSchemaError",
    "check_tool_depth",
    "check_tool_references",
    "embed_tool_parameters",
]

MAX_TOOL_SCHEMA_DEPTH = 100
"""The most levels of JSON nesting a tool's ``parameters`` may have (the object itself is
level 1). Real tools nest a handful; the server's required-calls schema puts them six
levels down at most, which stays under the 128 levels any JSON schema may have."""

# Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
_ONE = frozenset(
    {
        "additionalItems",
        "additionalProperties",
        "contains",
        "contentSchema",
        "else",
        "if",
        "items",
        "not",
        "propertyNames",
        "then",
        "unevaluatedItems",
        "unevaluatedProperties",
    }
)
_LIST = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_MAP = frozenset(
    {"$defs", "definitions", "dependentSchemas", "dependencies", "patternProperties", "properties"}
)
_REFUSED = ("$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor")


class ToolSchemaError(ValueError):
    """A tool's ``parameters`` the server cannot use; ``field`` names them
    (``tools[i].function.parameters``), the message says where and why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class EmbeddedParameters:
    """A tool's parameters ready for the server's schema: ``schema`` goes where the tool's
    parameters go (a ``$ref`` to ``$defs/<name>`` when ``definition`` is not ``None``, which
    then goes to the server's ``$defs`` under that name)."""

    schema: dict[str, Any]
    definition: dict[str, Any] | None = None


def check_tool_depth(parameters: Any, field: str) -> None:
    """Raise :class:`ToolSchemaError` when ``parameters`` nest deeper than
    :data:`MAX_TOOL_SCHEMA_DEPTH` (counted without recursion)."""
    stack: list[tuple[Any, int]] = [(parameters, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, Mapping):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_TOOL_SCHEMA_DEPTH:
            raise ToolSchemaError(
                field,
                f"{field} nests more than {MAX_TOOL_SCHEMA_DEPTH} levels of objects and "
                "arrays: flatten the schema (use $defs and $ref for repeated parts)",
            )
        stack.extend((child, depth + 1) for child in children)


def check_tool_references(parameters: Mapping[str, Any], field: str) -> None:
    """Raise :class:`ToolSchemaError` for what the module docstring refuses (the schema is
    used as it is: a named ``tool_choice``)."""
    for _ in _references(parameters, field):
        pass


def embed_tool_parameters(
    parameters: Mapping[str, Any], field: str, name: str
) -> EmbeddedParameters:
    """``parameters`` as they go into the server's schema under ``$defs/<name>`` (see the
    module docstring); inline, unchanged, when they hold no ``$ref``. ``name``: the tool's
    name (letters, digits, ``_``, ``.``, ``-``: a JSON pointer token as it is). The argument
    is not changed."""
    check_tool_depth(parameters, field)
    definition = copy.deepcopy(dict(parameters))  # depth-checked: a bounded recursion
    found = False
    prefix = f"#/$defs/{name}"
    for holder, pointer in _references(definition, field):
        holder["$ref"] = prefix + pointer
        found = True
    if not found:
        return EmbeddedParameters(dict(parameters))
    definition.pop("$id", None)
    definition.pop("$schema", None)
    return EmbeddedParameters({"$ref": prefix}, definition)


def _references(root: Mapping[str, Any], field: str) -> Iterator[tuple[Any, str]]:
    """Every schema holding a ``$ref`` under ``root`` with the ref's JSON pointer (``""``
    for ``#``, ``"/properties/x"`` for ``#/properties/x``, still percent-encoded), after
    checking it; raises :class:`ToolSchemaError` for what cannot be resolved safely."""
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, Mapping):
            continue  # true / false schemas, or a malformed one llguidance will name
        at = f"{field} at {where}" if where else field
        if where and "$id" in node:
            raise ToolSchemaError(
                field,
                f"{at} sets $id: an $id below the root changes what the $refs under it "
                "resolve against, which is not supported; remove it and point $refs at "
                "the schema with a JSON pointer ('#/$defs/Name')",
            )
        for keyword in _REFUSED:
            if keyword in node:
                raise ToolSchemaError(
                    field,
                    f"{at} uses {keyword}, which is not supported: name shared parts in "
                    "$defs and refer to them with a JSON pointer ('#/$defs/Name')",
                )
        if "$ref" in node:
            yield node, _checked_pointer(root, node["$ref"], field, at)
        for keyword, value in node.items():
            path = f"{where}/{keyword}"
            if keyword in _ONE and isinstance(value, Mapping):
                stack.append((value, path))
            elif keyword in _LIST and isinstance(value, list):
                stack.extend((item, f"{path}/{index}") for index, item in enumerate(value))
            elif keyword in _MAP and isinstance(value, Mapping):
                stack.extend((item, f"{path}/{_escape(key)}") for key, item in value.items())


def _checked_pointer(root: Mapping[str, Any], ref: Any, field: str, at: str) -> str:
    """The JSON pointer of ``ref`` (after its ``#``), once it is known to point into
    ``root``."""
    usage = "a $ref must point into the tool's own parameters: '#' or '#/json/pointer'"
    if not isinstance(ref, str):
        raise ToolSchemaError(field, f"{at}: $ref must be a string: {usage}")
    if not ref.startswith("#"):
        raise ToolSchemaError(
            field,
            f"{at}: $ref {_short(ref)} refers to another document, which the server never "
            f"fetches: {usage} (copy the schema into $defs)",
        )
    pointer = ref[1:]
    if pointer and not pointer.startswith("/"):
        raise ToolSchemaError(
            field, f"{at}: $ref {_short(ref)} names an anchor, which is not supported: {usage}"
        )
    target: Any = root
    for token in urllib.parse.unquote(pointer).split("/")[1:]:
        key = token.replace("~1", "/").replace("~0", "~")
        if isinstance(target, Mapping) and key in target:
            target = target[key]
        elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
            target = target[int(key)]
        else:
            raise ToolSchemaError(
                field, f"{at}: $ref {_short(ref)} points to nothing in the tool's parameters"
            )
    return pointer


def _escape(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _short(ref: str, limit: int = 80) -> str:
    return repr(ref if len(ref) <= limit else ref[:limit] + "...")
