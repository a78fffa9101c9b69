"""What a chat request's reasoning asks of the server: whether its answer starts in
reasoning, and its constraint (``response_format``, ``tool_choice`` ``"required"`` or a named
function) gated to start after the reasoning ends, as vLLM applies structured outputs with a
reasoning parser."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pagedinfer.domain.reasoning import ReasoningEnd
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.serving.fields import RequestFieldError
from pagedinfer.serving.reasoning.parsers import ReasoningParser

__all__ = ["ReasoningPlan", "plan_reasoning", "reasoning_end"]


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """A request's reasoning: the server's parser (``None``: none), whether the answer starts
    in reasoning, and the token that ends it (``None``: not one token of the vocabulary)."""

    parser: ReasoningParser | None = None
    thinking: bool = False
    end: ReasoningEnd | None = None

    def gated(self, params: SamplingParams, field: str) -> SamplingParams:
        """``params`` with its constraint starting after the reasoning (when the answer
        starts in reasoning); a 400 naming ``field`` (the constraint's request field) when
        the end marker is not one token, so that no gate can be set."""
        constraint = params.structured_outputs
        if constraint is None or self.parser is None or not self.thinking:
            return params
        if self.end is None:
            marker = self.parser.end_marker
            raise RequestFieldError(
                field,
                f"{field} applies to the answer after the reasoning, and this model's "
                f"vocabulary has no single {marker!r} token to start it at (the "
                f"--reasoning-parser {self.parser.name} marker): turn thinking off "
                '(chat_template_kwargs {"enable_thinking": false}) or send no constraint.',
            )
        gated = replace(constraint, reasoning_end=self.end)
        return replace(params, structured_outputs=gated)


def plan_reasoning(
    parser: ReasoningParser | None,
    end: ReasoningEnd | None,
    *,
    include_reasoning: bool,
    prompt_text: str | None,
    template_kwargs: Mapping[str, Any] | None,
    continued: bool = False,
) -> ReasoningPlan:
    """A chat request's :class:`ReasoningPlan` (``prompt_text``: the rendered prompt, or
    its end; ``template_kwargs``: the chat template's variables; ``continued``: the answer
    continues the last message). ``include_reasoning=false`` without a parser is a 400: the
    reasoning could not be left out."""
    if parser is None:
        if not include_reasoning:
            raise RequestFieldError(
                "include_reasoning",
                "include_reasoning=false needs a reasoning parser, and this server has none "
                "(--reasoning-parser): the reasoning stays in the content. Drop the field.",
            )
        return ReasoningPlan()
    thinking = parser.thinking(prompt_text, template_kwargs, continued=continued)
    return ReasoningPlan(parser, thinking, end)


def reasoning_end(
    parser: ReasoningParser | None, tokenizer: Any, vocab_size: int
) -> ReasoningEnd | None:
    """The token that ends ``parser``'s reasoning in ``tokenizer``'s vocabulary (``None``:
    no parser, no tokenizer, or the marker is not one token)."""
    if parser is None or tokenizer is None:
        return None
    token_id = tokenizer.get_vocab().get(parser.end_marker)
    if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
        return None
    return ReasoningEnd((token_id,))
