"""The submission probe: walk a compiled grammar's first tokens before the request is queued.

llguidance builds its lexer lazily: a regex such as ``a{1000000}`` compiles at once and only
blows up when the first ``a`` is consumed, and a schema that accepts no string at all
(``{"$ref": "#"}``, the regex ``[^\\s\\S]``) compiles too. :func:`probe_grammar` runs what the
step loop would run, on a copy of the start state and within the engine's limits: the first
mask, then up to ``steps`` tokens, each the smallest allowed token that is neither EOS nor only
whitespace (so a JSON value's walk reaches its strings and numbers instead of looping on
spaces). It returns why the constraint must be refused, or ``None``:

* an empty language: nothing but an error, or no token at all, at the start state;
* a limit hit or any matcher error during the walk (lexer fuel, states, items).

A grammar that passes can still fail later (a blow-up deeper than the walk, or only on tokens
the walk did not choose): that ends its own request at run time with ``finish_reason
"error"``, never the step (``GrammarMatchers``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

__all__ = ["probe_grammar"]

_WHITESPACE = frozenset(b" \t\r\n")


def probe_grammar(
    template: Any, ll_tokenizer: Any, eos_token_ids: Collection[int], steps: int
) -> str | None:
    """Why ``template`` (an llguidance matcher in its start state) must be refused, or
    ``None`` (see the module docstring). Walks ``template`` itself and resets it to its start
    state after: the lexer states the walk built stay in its cache, so the requests' copies
    do not build them again in the step loop."""
    try:
        return _walk(template, ll_tokenizer, frozenset(eos_token_ids), steps)
    finally:
        template.reset()


def _walk(matcher: Any, ll_tokenizer: Any, eos: frozenset[int], steps: int) -> str | None:
    for taken in range(steps + 1):
        mask = int.from_bytes(matcher.compute_bitmask(), "little")
        if matcher.is_error():
            return _reason(matcher, taken)
        if not mask:
            return "it accepts no string (the language is empty)" if taken == 0 else None
        if taken == steps:
            return None
        token = _pick(mask, eos, ll_tokenizer)
        if token is None:  # only EOS: the output may end here
            if taken == 0 and not matcher.is_accepting():
                return "it accepts no string (the language is empty)"
            return None
        if not matcher.consume_token(token):
            return _reason(matcher, taken + 1)
    return None


def _pick(mask: int, eos: frozenset[int], ll_tokenizer: Any) -> int | None:
    """The smallest allowed token that is not EOS and not only whitespace; else the smallest
    non-EOS token; ``None`` when only EOS is allowed."""
    fallback = None
    while mask:
        low = mask & -mask
        token = low.bit_length() - 1
        mask ^= low
        if token in eos:
            continue
        text = ll_tokenizer.decode_bytes([token])
        if text and not set(text) <= _WHITESPACE:
            return token
        if fallback is None:
            fallback = token
    return fallback


def _reason(matcher: Any, taken: int) -> str:
    error = str(matcher.get_error()).strip().splitlines()
    first = error[0] if error else "unknown error"
    stop = str(matcher.stop_reason())
    if taken == 0 and ("NoExtension" in stop or first.startswith("NoExtension")):
        return "it accepts no string (the language is empty)"
    if "too many" in first or stop in ("LexerTooComplex", "ParserTooComplex") or ("limit" in first):
        return (
            f"it is too complex for the grammar limits after {taken} token(s) ({first}): "
            "simplify it (smaller repetition counts, fewer nested quantifiers), or raise the "
            "engine's grammar limits (GrammarLimits, --grammar-* flags)"
        )
    return f"the grammar engine failed after {taken} token(s): {first}"
