"""What the engine hands back: finished (or in-progress) requests and streaming deltas."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestOutput", "StreamDelta"]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's state after a step; final once ``finished`` is True.

    ``token_ids`` are the generated tokens only (the prompt is in ``prompt_token_ids``).
    ``text`` is their detokenized form with a matched stop string cut off (empty when the
    checkpoint has no tokenizer). ``finish_reason`` is ``"stop"`` (EOS, stop token, stop
    string), ``"length"`` (``max_tokens`` or ``max_model_len``), ``"abort"`` or ``None`` while
    running. ``num_cached_tokens`` counts prompt tokens served from the prefix cache.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """What one step added to a streamed request."""

    request_id: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
