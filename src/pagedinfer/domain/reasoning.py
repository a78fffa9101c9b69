"""Where a thinking model's reasoning ends, for constraints that apply to the answer only.

Thinking models (Qwen3, DeepSeek-R1, ...) write their reasoning before the answer and end it
with a marker token (``</think>``). A structured-outputs constraint meant for the answer (a
JSON schema, tool calls) must not bind the reasoning: with
``StructuredOutputsParams(..., reasoning_end=ReasoningEnd((end_id,)))`` every token up to and
including the first of ``token_ids`` that the model generates is left unconstrained, and the
grammar starts with the token after it, as vLLM does with a reasoning parser. A request
whose prompt already ended the reasoning (Qwen3's ``enable_thinking=False`` template) should
carry no ``reasoning_end``: its answer is constrained from the first token. Until the end
token comes the output is free, EOS included (a model that never ends its reasoning is never
constrained).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from pagedinfer.errors import InvalidStructuredOutputError

__all__ = ["ReasoningEnd"]


@dataclass(frozen=True, slots=True)
class ReasoningEnd:
    """The token ids that end the reasoning (any one of them does); not empty, each a
    non-negative integer (a sequence is stored as a tuple)."""

    token_ids: Sequence[int]

    def __post_init__(self) -> None:
        token_ids: object = self.token_ids
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            _fail(token_ids)
        ids: tuple[object, ...] = tuple(token_ids)
        if not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            _fail(token_ids)
        object.__setattr__(self, "token_ids", ids)


def _fail(value: object) -> NoReturn:
    raise InvalidStructuredOutputError(
        f"ReasoningEnd.token_ids={value!r} is invalid: expected a non-empty list of token ids "
        "(integers >= 0), such as the id of '</think>'."
    )
