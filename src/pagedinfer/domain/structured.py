"""Structured outputs: what a request's completion must match (vLLM's ``StructuredOutputsParams``).

``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`` constrains every
completion of a request to a JSON schema, a regular expression, one of a list of strings, a
context-free grammar (Lark, or GBNF / EBNF as llama.cpp writes it) or any JSON object. The
sampler masks, at every step, the tokens that cannot continue a valid output (a grammar engine
computes the mask from the tokens accepted so far); EOS is allowed only where the output is
complete. This module is the pure-Python value: it checks the *shape* of the constraint (exactly
one is set, the types, that a JSON schema is JSON); whether the schema, regex or grammar compiles
is checked when the request is submitted (``Engine.check_sampling_params``), which raises
:class:`~pagedinfer.errors.InvalidStructuredOutputError` naming the problem.

The value is frozen and hashable (a schema given as a dict is stored as its JSON text, key order
kept: it is the order in which the properties are generated), so it keys the cache of compiled
grammars and can be shared by every request of a batch.
"""

from __future__ import annotations

import json as _json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, NoReturn

from pagedinfer.domain.json_depth import json_depth_exceeds
from pagedinfer.domain.reasoning import ReasoningEnd
from pagedinfer.errors import InvalidStructuredOutputError

__all__ = ["ConstraintKind", "GuidedDecodingParams", "StructuredOutputsParams"]

ConstraintKind = Literal["json", "regex", "choice", "grammar", "json_object", "structural_tag"]
_CONSTRAINTS: tuple[ConstraintKind, ...] = (
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "structural_tag",
)
# The knobs below shape the JSON grammar only (json and json_object).
_JSON_KNOBS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
MAX_SCHEMA_DEPTH = 512
"""The deepest JSON schema this value holds at all (Python's ``json`` recurses per level);
engines refuse much less deep ones (``GrammarLimits.max_json_depth``, default 128)."""


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint on a request's output, with vLLM's field names; exactly one is set.

    * ``json``: a JSON schema, as a dict, as its JSON text, or a pydantic model class (its
      ``model_json_schema()``). Stored as JSON text (key order kept); :attr:`schema` parses it.
      The output is one JSON value valid under the schema (``type``, ``properties``,
      ``required``, ``additionalProperties``, ``items`` / ``prefixItems``, ``minItems`` /
      ``maxItems``, ``enum`` / ``const``, ``minimum`` / ``maximum`` (also exclusive),
      ``minLength`` / ``maxLength``, ``pattern``, ``format``, ``anyOf`` / ``oneOf`` /
      ``allOf``, ``$ref`` / ``$defs``; docs/structured-outputs.md lists what the grammar
      engine does not support).
    * ``regex``: the output matches the regular expression as a whole (Rust ``regex``
      syntax: what Python's ``re`` writes for the common cases; no look-around or
      back-references).
    * ``choice``: the output is exactly one of these strings.
    * ``grammar``: a context-free grammar in Lark syntax (llguidance's dialect: ``start:`` is
      the start rule, ``/regex/`` terminals, ``%json {schema}`` embeds a JSON schema) or in
      GBNF (llama.cpp's EBNF: ``root ::= ...``), recognised by its ``::=``.
    * ``json_object=True``: any JSON object (OpenAI's ``{"type": "json_object"}``).
    * ``structural_tag``: vLLM's structural tag, a JSON text ``{"type": "structural_tag",
      "structures": [{"begin": ..., "schema": {...}, "end": ...}], "triggers": [...]}``:
      free text in which each segment that starts with a trigger continues as one of the
      structures (tool calls inside text).

    Knobs (JSON constraints only; set with another constraint they raise):
    ``disable_any_whitespace`` allows no whitespace between JSON tokens (compact output);
    ``disable_additional_properties`` treats every object schema without
    ``additionalProperties`` as ``additionalProperties: false`` (by JSON Schema's default,
    extra properties are allowed); ``whitespace_pattern`` is a regex for the whitespace
    allowed between JSON tokens. ``disable_fallback`` is accepted for vLLM's sake and changes
    nothing: there is one grammar engine and never a fallback.

    ``reasoning_end`` (a :class:`~pagedinfer.domain.reasoning.ReasoningEnd`): the constraint
    applies to a thinking model's answer only, from the token after the first reasoning-end
    token it generates; ``None`` (the default): from the first token.

    ``compiled`` is not part of the value (not compared, hashed, shown or pickled): the
    engine's compiled grammar, set on the copy that ``Engine.check_sampling_params`` returns,
    so that a request carries its grammar from submission to finish.
    """

    json: str | Mapping[str, Any] | type[Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    reasoning_end: ReasoningEnd | None = None
    compiled: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.choice is not None:
            choice: object = self.choice
            if isinstance(choice, (str, bytes, Mapping)) or not isinstance(choice, Sequence):
                _fail("choice", choice, "a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(choice))
        self._validate()

    def with_compiled(self, compiled: object) -> StructuredOutputsParams:
        """A copy of this constraint carrying ``compiled`` (the engine's grammar)."""
        copy = replace(self)
        object.__setattr__(copy, "compiled", compiled)
        return copy

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (to other processes) without the compiled grammar: it stays in this one.
        values = {item.name: getattr(self, item.name) for item in fields(self)}
        values.pop("compiled")
        return (_rebuild, (values,))

    @property
    def text_size(self) -> int:
        """Characters of the constraint's text (schema JSON, regex, grammar, choices)."""
        value = getattr(self, self.kind)
        if isinstance(value, str):
            return len(value)
        if isinstance(value, tuple):
            return sum(len(item) for item in value)
        return 0

    # ------------------------------------------------------------------ derived
    @property
    def kind(self) -> ConstraintKind:
        """Which constraint is set."""
        for name in _CONSTRAINTS:
            value = getattr(self, name)
            if value is not None and value is not False:
                return name
        raise AssertionError("validated: one constraint is set")  # pragma: no cover

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema (a new dict each call), or None when ``json`` is not set."""
        if self.json is None:
            return None
        assert isinstance(self.json, str)  # stored as its JSON text
        parsed: dict[str, Any] = _json.loads(self.json)
        return parsed

    @property
    def cache_key(self) -> tuple[object, ...]:
        """What the compiled grammar depends on (``disable_fallback`` does not count)."""
        return (
            self.kind,
            getattr(self, self.kind),
            self.disable_any_whitespace,
            self.disable_additional_properties,
            self.whitespace_pattern,
        )

    # --------------------------------------------------------------- validation
    def _validate(self) -> None:
        set_ = [
            name
            for name in _CONSTRAINTS
            if getattr(self, name) is not None and getattr(self, name) is not False
        ]
        if len(set_) != 1:
            given = ", ".join(set_) if set_ else "none"
            raise InvalidStructuredOutputError(
                f"StructuredOutputsParams needs exactly one constraint of "
                f"{', '.join(_CONSTRAINTS)}; got {given}. Set one (json_object=True for any "
                "JSON object)."
            )
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(name, value, "a non-empty string")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            _fail("json_object", self.json_object, "True, False or None")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            _fail("choice", self.choice, "a non-empty list of non-empty strings")
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "True or False")
        if self.whitespace_pattern is not None and (
            not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern
        ):
            _fail("whitespace_pattern", self.whitespace_pattern, "None or a non-empty regex")
        if self.whitespace_pattern is not None and self.disable_any_whitespace:
            raise InvalidStructuredOutputError(
                "StructuredOutputsParams.whitespace_pattern and disable_any_whitespace=True "
                "contradict each other: set one of them."
            )
        kind = set_[0]
        if kind not in ("json", "json_object"):
            for knob in _JSON_KNOBS:
                value = getattr(self, knob)
                if value is not None and value is not False:
                    raise InvalidStructuredOutputError(
                        f"StructuredOutputsParams.{knob} shapes JSON output and applies to "
                        f"json and json_object only, not to {kind}: drop it."
                    )
        if kind == "structural_tag":
            _check_structural_tag(self.structural_tag)
        if self.reasoning_end is not None and not isinstance(self.reasoning_end, ReasoningEnd):
            _fail("reasoning_end", self.reasoning_end, "None or a ReasoningEnd(token_ids)")

    def __repr__(self) -> str:
        shown = []
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name != "compiled" and value != item.default:
                text = repr(value)
                if len(text) > 200:
                    text = f"{text[:160]}... ({len(text)} characters)"
                shown.append(f"{item.name}={text}")
        return f"StructuredOutputsParams({', '.join(shown)})"


GuidedDecodingParams = StructuredOutputsParams
"""vLLM's older name of :class:`StructuredOutputsParams` (the same class)."""


def _rebuild(values: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(**values)


def _schema_text(value: object) -> str:
    """A JSON schema as JSON text: a dict, its JSON text, or a pydantic model class."""
    to_schema = getattr(value, "model_json_schema", None)
    if isinstance(value, type) and callable(to_schema):
        value = to_schema()  # a pydantic model class
    if isinstance(value, str):
        try:
            parsed = _json.loads(value)
        except RecursionError:
            _too_deep()
        except ValueError as error:
            raise InvalidStructuredOutputError(
                f"StructuredOutputsParams.json is not valid JSON ({error}): pass a JSON schema "
                "as a dict or as its JSON text."
            ) from None
    elif isinstance(value, Mapping):
        parsed = value
    else:
        _fail("json", value, "a JSON schema: a dict, its JSON text or a pydantic model class")
    if not isinstance(parsed, Mapping):
        _fail("json", value, "a JSON schema object ({...}), not another JSON value")
    if json_depth_exceeds(parsed, MAX_SCHEMA_DEPTH) is not None:
        _too_deep()
    try:
        return _json.dumps(parsed, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidStructuredOutputError(
            f"StructuredOutputsParams.json holds something that is not JSON ({error}): a schema "
            "is made of dicts, lists, strings, finite numbers, booleans and None."
        ) from None


def _too_deep() -> NoReturn:
    raise InvalidStructuredOutputError(
        f"StructuredOutputsParams.json nests deeper than {MAX_SCHEMA_DEPTH} levels (objects and "
        "arrays): flatten the schema (use $defs and $ref for repeated parts)."
    )


def _check_structural_tag(text: str | None) -> None:
    assert text is not None
    try:
        tag = _json.loads(text)
    except ValueError as error:
        raise InvalidStructuredOutputError(
            f"StructuredOutputsParams.structural_tag is not valid JSON ({error})."
        ) from None
    expected = (
        'a JSON object {"structures": [{"begin": str, "schema": {...}, "end": str}, ...], '
        '"triggers": [str, ...]} in which every begin starts with one of the triggers'
    )
    if not isinstance(tag, dict):
        _fail("structural_tag", text, expected)
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if (
        not isinstance(structures, list)
        or not structures
        or not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) and t for t in triggers)
    ):
        _fail("structural_tag", text, expected)
    for structure in structures:
        if (
            not isinstance(structure, dict)
            or not isinstance(structure.get("begin"), str)
            or not isinstance(structure.get("end"), str)
            or not isinstance(structure.get("schema"), dict)
            or not any(structure["begin"].startswith(t) for t in triggers)
        ):
            _fail("structural_tag", text, expected)


def _fail(field: str, value: object, allowed: str) -> NoReturn:
    shown = repr(value)
    if len(shown) > 200:
        shown = f"{shown[:160]}... ({len(shown)} characters)"
    raise InvalidStructuredOutputError(
        f"StructuredOutputsParams.{field}={shown} is invalid: expected {allowed}."
    )
