"""What the engine hands back, shaped like vLLM's outputs.

A :class:`RequestOutput` per request, holding one :class:`CompletionOutput` per completion
(``SamplingParams.n``). Outputs of ``generate`` and ``step`` are cumulative (everything so
far); ``stream`` yields the same types holding only what is new since the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

__all__ = [
    "CompletionOutput",
    "Logprob",
    "PromptLogprobs",
    "RequestOutput",
    "SampleLogprobs",
]


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: {token id: Logprob} for the top tokens and the chosen one.
SampleLogprobs: TypeAlias = list[dict[int, Logprob]]
# Per prompt token (None for the first, which nothing predicts).
PromptLogprobs: TypeAlias = list[dict[int, Logprob] | None]


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One completion of a request.

    ``index`` is its place among the request's ``n`` completions. ``token_ids`` are the
    generated tokens; ``text`` their detokenized form (empty without a tokenizer; a matched
    stop string is cut off unless ``include_stop_str_in_output``). ``logprobs`` has one
    entry per generated token when the request asked for them, and ``cumulative_logprob``
    their sum (else both ``None``). ``finish_reason`` is ``"stop"`` (EOS, stop token, stop
    string; on a structured-output request, EOS comes only where the grammar accepts the
    output), ``"length"`` (``max_tokens`` or ``max_model_len``), ``"abort"``, ``"error"``
    (the request's own input failed it while running: its constraint hit a grammar limit or
    a dead end, or its logits held no finite allowed token; ``error`` says why, and the
    output so far is kept), or ``None`` while running; ``stop_reason`` is the stop token id or
    stop string that ended it (``None`` for EOS and the other reasons).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's state after a step; final once ``finished`` is True.

    ``request_id`` is a string, as in vLLM: the decimal form of the engine's request
    counter (``"0"``, ``"1"``, ...; with ``n > 1`` ids advance by ``n``), the id
    ``Engine.add_request`` returned and ``Engine.abort`` takes; an ``AsyncEngine`` stream's
    outputs carry the stream's own ``request_id``. ``prompt`` is the prompt's text
    (``None`` for token-id prompts), ``prompt_token_ids`` its tokens, ``prompt_logprobs``
    one entry per prompt token when the request asked for them (``None`` for the first
    token; else ``None`` altogether). ``outputs`` holds the completions in index order.
    ``num_cached_tokens`` counts prompt tokens served from the prefix cache. ``pooled``: a
    pooling model's pooled hidden state once finished (``LLM.embed`` shapes it).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    pooled: list[float] | None = None
