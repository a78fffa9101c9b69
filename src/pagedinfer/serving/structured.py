"""A request's structured-output fields as one :class:`StructuredOutputsParams` (vLLM's rules).

Completions and chat take the same fields:

* ``response_format`` (OpenAI's): ``{"type": "text"}`` (nothing), ``{"type":
  "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}}`` (the schema; ``strict`` is accepted either way: the
  output always matches), or vLLM's ``{"type": "structural_tag", "structures": [...],
  "triggers": [...]}``;
* ``structured_outputs`` (vLLM's): an object with :class:`StructuredOutputsParams`' fields
  (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag`` and the
  knobs ``disable_any_whitespace``, ``disable_additional_properties``,
  ``whitespace_pattern``, ``disable_fallback``);
* vLLM's older fields ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``, ``structural_tag`` (one constraint each), ``guided_whitespace_pattern``
  (the ``whitespace_pattern`` knob) and ``guided_decoding_backend``: the grammar engine is the
  server's, so a value other than ``"auto"`` or the server's own is a 400 (vLLM refuses a
  request-level backend choice the same way).

One constraint per request: ``response_format`` may take its knobs from
``structured_outputs`` (vLLM merges them the same way), but two fields that each constrain
the output are a 400 naming the second, as is a ``structured_outputs`` given together with
the ``guided_*`` fields it replaces (neither is dropped silently). A malformed constraint is
a 400 naming its field; one that does not compile is found when the request is checked
(``Engine.check_sampling_params``), and is a 400 naming the field as well.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pagedinfer.domain.structured import StructuredOutputsParams
from pagedinfer.errors import InvalidStructuredOutputError
from pagedinfer.serving.fields import RequestFieldError

__all__ = ["BACKENDS", "GUIDED_FIELDS", "StructuredRequest", "structured_request"]

# guided_decoding_backend values a request may send: the server has one grammar engine.
BACKENDS = frozenset({"auto", "guidance", "llguidance"})
# vLLM's older request fields, and the StructuredOutputsParams field each sets.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structural_tag": "structural_tag",
    "guided_whitespace_pattern": "whitespace_pattern",
}
# Request-settable: not the engine's compiled grammar nor the reasoning end (the server's).
_PARAMS = frozenset(item.name for item in fields(StructuredOutputsParams)) - {
    "compiled",
    "reasoning_end",
}
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_NAMED = re.compile(r"StructuredOutputsParams\.(\w+)")


@dataclass(frozen=True, slots=True)
class StructuredRequest:
    """The constraint and the request field it came from (errors name that field)."""

    params: StructuredOutputsParams
    field: str

    def error(self, error: InvalidStructuredOutputError) -> RequestFieldError:
        """The 400 for a constraint that does not compile."""
        return RequestFieldError(self.field, f"{self.field}: {error}")


def structured_request(
    request: Any, tools: StructuredOutputsParams | None = None
) -> StructuredRequest | None:
    """The constraint a completion or chat request asks for (``None``: none). ``tools``: the
    constraint of its ``tool_choice`` (``"required"``, a named function), which takes the
    request's JSON knobs (its own whitespace rule gives way to theirs) and no other
    constraint."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}  # StructuredOutputsParams field -> request field
    if tools is not None:
        values["json"] = tools.json
        sources["json"] = "tools"

    def put(name: str, value: Any, field: str) -> None:
        if name in _CONSTRAINTS and (value is None or value is False):
            return
        if name in _CONSTRAINTS:
            given = next((n for n in _CONSTRAINTS if n in values), None)
            if given is not None and sources[given] == "tools":
                raise _bad(
                    field,
                    f"{field} and tool_choice={request.tool_choice!r} both constrain the "
                    "answer (the calls are decoded under their functions' schemas): send one "
                    'of them (tool_choice "auto" or "none" may go with it)',
                )
            if given is not None:
                raise _bad(
                    field,
                    f"{field} and {sources[given]} both constrain the output: give one of them",
                )
        values[name] = value
        sources[name] = field

    structured = request.structured_outputs
    if structured is not None:
        if not isinstance(structured, Mapping):
            raise _bad("structured_outputs", "structured_outputs must be an object")
        for name, value in structured.items():
            field = f"structured_outputs.{name}"
            if name not in _PARAMS:
                raise _bad(
                    field,
                    f"{field} is not a structured-outputs field: expected one of "
                    f"{', '.join(sorted(_PARAMS))}",
                )
            if value is not None:
                put(name, value, field)
    for field, name in GUIDED_FIELDS.items():
        value = getattr(request, field)
        if value is None:
            continue
        if structured is not None:
            raise _bad(
                field,
                f"{field} is vLLM's older spelling of structured_outputs.{name}; with "
                f"structured_outputs given, put it there",
            )
        put(name, value, field)
    backend = request.guided_decoding_backend
    if backend is not None and backend not in BACKENDS:
        raise _bad(
            "guided_decoding_backend",
            f"guided_decoding_backend={backend!r} is not this server's: it decodes with "
            "llguidance, chosen by the server and not per request. Remove the field",
        )
    response_format = request.response_format
    if response_format is not None:
        constraint = _response_format(response_format)
        if constraint is not None:
            put(*constraint, "response_format")
    if tools is not None and not (
        values.get("disable_any_whitespace") or values.get("whitespace_pattern")
    ):
        values["whitespace_pattern"] = tools.whitespace_pattern
    if not any(name in values for name in _CONSTRAINTS):
        knobs = sorted(sources[name] for name, value in values.items() if value)
        if knobs:
            raise _bad(
                knobs[0],
                f"{knobs[0]} shapes JSON output but the request asks for none: add a "
                'constraint (response_format {"type": "json_object"}, a json schema, ...) or '
                "drop it",
            )
        return None
    field = next(sources[name] for name in _CONSTRAINTS if name in values)
    try:
        params = StructuredOutputsParams(**values)
    except InvalidStructuredOutputError as error:
        # The message names the StructuredOutputsParams field at fault: name the request's.
        named = _NAMED.search(str(error))
        if named is not None and named.group(1) in sources:
            field = sources[named.group(1)]
        raise _bad(field, f"{field}: {error}") from None
    return StructuredRequest(params, field)


def _response_format(value: Any) -> tuple[str, Any] | None:
    """The constraint of OpenAI's ``response_format`` (``None`` for text)."""
    usage = (
        'expected {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
        '"json_schema": {"name": ..., "schema": {...}}}'
    )
    if not isinstance(value, Mapping):
        raise _bad("response_format", f"response_format must be an object: {usage}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise _bad(
                "response_format.json_schema",
                f'response_format of type "json_schema" needs its json_schema: {usage}',
            )
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise _bad(
                "response_format.json_schema.name",
                "response_format.json_schema.name is required (a name for the schema)",
            )
        schema = spec.get("schema")
        if not isinstance(schema, Mapping):
            raise _bad(
                "response_format.json_schema.schema",
                "response_format.json_schema.schema must be a JSON schema object",
            )
        return "json", schema
    if kind == "structural_tag":
        return "structural_tag", json.dumps(value)
    raise _bad("response_format", f"response_format type {kind!r} is not supported: {usage}")


def _bad(param: str, message: str) -> RequestFieldError:
    return RequestFieldError(param, message.rstrip(".") + ".")
