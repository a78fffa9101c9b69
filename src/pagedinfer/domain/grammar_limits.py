"""Grammar limits: bounds on what one structured-output constraint may cost.

A constraint (JSON schema, regex, grammar, choice) is user input, and the grammar engine's work
grows with it: a regex like ``a{1000000}`` or ``((a{100}){100}){100}`` makes the lexer build
millions of states, a deeply nested schema recurses. :class:`GrammarLimits` bounds that work:

* ``max_chars``: characters of the constraint's text (schema JSON, regex, grammar, choices);
* ``max_json_depth``: nesting of a JSON schema (objects and arrays), checked without recursion
  (:mod:`pagedinfer.domain.json_depth`);
* the grammar engine's own limits (llguidance's ``LLParserLimits``; its documented speeds:
  lexer fuel ~14k per ms, Earley items ~20k per ms): ``initial_lexer_fuel`` (building the
  lexer), ``step_lexer_fuel`` (one token's mask), ``step_max_items`` (one token's parser items),
  ``max_lexer_states``, ``max_grammar_size`` (symbols in the productions) and
  ``max_items_in_row``;
* ``probe_tokens``: how many tokens the submission probe walks from the start state.

The defaults keep one token's mask under roughly 10 ms of CPU and refuse the classic blow-ups
at submission. ``Engine(grammar_limits=GrammarLimits(...))`` and the ``--grammar-*`` flags of
``pagedinfer serve`` change them; docs/structured-outputs.md documents each.

Pure Python (the domain layer).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagedinfer.errors import ConfigurationError

__all__ = ["DEFAULT_GRAMMAR_LIMITS", "GRAMMAR_LIMIT_HELP", "GrammarLimits"]

GRAMMAR_LIMIT_HELP = {
    "max_chars": "most characters of a constraint's text (schema JSON, regex, grammar, choices)",
    "max_json_depth": "deepest JSON schema nesting (objects and arrays)",
    "initial_lexer_fuel": "grammar engine fuel to build a constraint's lexer",
    "step_lexer_fuel": "grammar engine lexer fuel per token (~14k per ms)",
    "step_max_items": "grammar engine parser items per token (~20k per ms)",
    "max_lexer_states": "most lexer states per constraint (about 1-2 kB each)",
    "max_grammar_size": "most symbols in a constraint's grammar",
    "max_items_in_row": "most parser items in one grammar row",
    "probe_tokens": "tokens the submission probe walks (0: first mask only)",
}
"""One line per limit, for the ``--grammar-*`` flags' help."""


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """The most one structured-output constraint may cost (a frozen value; see the module)."""

    max_chars: int = 65_536
    max_json_depth: int = 128
    initial_lexer_fuel: int = 500_000
    step_lexer_fuel: int = 100_000
    step_max_items: int = 20_000
    max_lexer_states: int = 50_000
    max_grammar_size: int = 200_000
    max_items_in_row: int = 2_000
    probe_tokens: int = 8

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            minimum = 0 if item.name == "probe_tokens" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigurationError(
                    f"GrammarLimits.{item.name}={value!r} is invalid: expected an integer "
                    f">= {minimum} (the default is {item.default})."
                )

    def engine_limits(self) -> dict[str, int]:
        """The grammar engine's limits (llguidance ``LLParserLimits`` keyword arguments)."""
        return {
            "initial_lexer_fuel": self.initial_lexer_fuel,
            "step_lexer_fuel": self.step_lexer_fuel,
            "step_max_items": self.step_max_items,
            "max_lexer_states": self.max_lexer_states,
            "max_grammar_size": self.max_grammar_size,
            "max_items_in_row": self.max_items_in_row,
        }


DEFAULT_GRAMMAR_LIMITS = GrammarLimits()
