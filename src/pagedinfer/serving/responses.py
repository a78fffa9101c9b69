"""Engine outputs to OpenAI response bodies: completions, chat completions, stream chunks.

This is the one module that reads the engine's output objects (:func:`completions_of`);
everything else in the server works on :class:`Completion` views, so a change of the
engine's output shape is one edit here. Bodies are plain dicts (serialized once with
``json.dumps``): a streamed token costs one small dict, not a pydantic model.

Choices are numbered as OpenAI and vLLM do: with several prompts and ``n`` completions each,
choice ``prompt_index * n + completion_index``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedinfer.engine.outputs import RequestOutput

__all__ = [
    "ChoiceCursor",
    "Completion",
    "ResponseContext",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "completions_of",
    "sse",
    "usage",
]

# JSON has no -inf: a token the model rules out gets vLLM's stand-in.
_MIN_LOGPROB = -9999.0

TokenText = Callable[[int], str]


@dataclass(frozen=True, slots=True)
class Completion:
    """One completion of a request, as the server needs it (cumulative so far)."""

    index: int
    text: str
    token_ids: Sequence[int]
    finish_reason: str | None
    stop_reason: int | str | None
    # Per generated token, {token_id: Logprob} (None unless the request asked for logprobs).
    logprobs: Sequence[Mapping[int, Any]] | None


def completions_of(output: RequestOutput) -> list[Completion]:
    """The completions of one engine output (the only place that knows its shape)."""
    return [
        Completion(
            index=completion.index,
            text=completion.text,
            token_ids=completion.token_ids,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            logprobs=completion.logprobs,
        )
        for completion in output.outputs
    ]


def prompt_length(output: RequestOutput) -> int:
    return len(output.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class ResponseContext:
    """What every body of one response shares."""

    response_id: str
    model: str
    created: int
    token_text: TokenText  # decodes one token id (logprobs entries without decoded text)
    num_logprobs: int | None  # top log-probabilities per token; None: none asked for
    return_token_ids: bool = False


class ChoiceCursor:
    """How much of one choice a stream has sent; cuts the next delta from a cumulative view.

    The engine's cumulative text only ever grows (text that could still turn out to start a
    stop string is held back until it cannot), so a delta is a plain slice.
    """

    __slots__ = ("chars", "finished", "started", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.chars = 0
        self.started = False
        self.finished = False

    def advance(self, completion: Completion) -> tuple[str, slice]:
        """The text and the token range that are new since the previous call."""
        text = completion.text[self.chars :]
        tokens = slice(self.tokens, len(completion.token_ids))
        self.chars = len(completion.text)
        self.tokens = len(completion.token_ids)
        return text, tokens


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    prompt_tokens = sum(prompt_length(output) for output in outputs)
    completion_tokens = sum(
        len(completion.token_ids) for output in outputs for completion in completions_of(output)
    )
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(body: Mapping[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n"


# ------------------------------------------------------------------------- completions
def completion_response(
    context: ResponseContext, outputs: Sequence[RequestOutput], n: int
) -> dict[str, Any]:
    choices = []
    for prompt_index, output in enumerate(outputs):
        for completion in completions_of(output):
            choice: dict[str, Any] = {
                "index": prompt_index * n + completion.index,
                "text": completion.text,
                "logprobs": _completion_logprobs(
                    context, completion, slice(0, len(completion.token_ids)), 0
                ),
                "finish_reason": _finish_reason(completion.finish_reason),
                "stop_reason": completion.stop_reason,
            }
            if context.return_token_ids:
                choice["token_ids"] = list(completion.token_ids)
                choice["prompt_token_ids"] = list(output.prompt_token_ids)
            choices.append(choice)
    choices.sort(key=lambda choice: choice["index"])
    return {
        "id": context.response_id,
        "object": "text_completion",
        "created": context.created,
        "model": context.model,
        "choices": choices,
        "usage": usage(outputs),
    }


def completion_chunk(
    context: ResponseContext,
    index: int,
    completion: Completion,
    cursor: ChoiceCursor,
    prompt_token_ids: Sequence[int],
) -> dict[str, Any] | None:
    """The chunk for what is new in one choice; None when nothing is."""
    offset = cursor.chars
    text, tokens = cursor.advance(completion)
    finished = completion.finish_reason is not None
    if not text and tokens.start == tokens.stop and not finished:
        return None
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": _completion_logprobs(context, completion, tokens, offset),
        "finish_reason": _finish_reason(completion.finish_reason),
        "stop_reason": completion.stop_reason,
    }
    if context.return_token_ids:
        choice["token_ids"] = list(completion.token_ids[tokens])
        if not cursor.started:
            choice["prompt_token_ids"] = list(prompt_token_ids)
    cursor.started = True
    cursor.finished = finished
    return _chunk(context, "text_completion", choice)


def _completion_logprobs(
    context: ResponseContext, completion: Completion, tokens: slice, text_offset: int
) -> dict[str, Any] | None:
    if context.num_logprobs is None or completion.logprobs is None:
        return None
    token_strings: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for token_id, entries in zip(
        completion.token_ids[tokens], completion.logprobs[tokens], strict=True
    ):
        token = _token_string(context, token_id, entries.get(token_id))
        token_strings.append(token)
        token_logprobs.append(_logprob_value(entries.get(token_id)))
        top_logprobs.append(
            {
                _token_string(context, other, entry): _logprob_value(entry)
                for other, entry in _ranked(entries, context.num_logprobs, keep=token_id)
            }
        )
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": token_strings,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


# -------------------------------------------------------------------------------- chat
def chat_response(
    context: ResponseContext, output: RequestOutput, *, role: str = "assistant"
) -> dict[str, Any]:
    choices = []
    for completion in completions_of(output):
        choice: dict[str, Any] = {
            "index": completion.index,
            "message": {"role": role, "content": completion.text},
            "logprobs": _chat_logprobs(context, completion, slice(0, len(completion.token_ids))),
            "finish_reason": _finish_reason(completion.finish_reason),
            "stop_reason": completion.stop_reason,
        }
        if context.return_token_ids:
            choice["token_ids"] = list(completion.token_ids)
        choices.append(choice)
    body: dict[str, Any] = {
        "id": context.response_id,
        "object": "chat.completion",
        "created": context.created,
        "model": context.model,
        "choices": choices,
        "usage": usage([output]),
    }
    if context.return_token_ids:
        body["prompt_token_ids"] = list(output.prompt_token_ids)
    return body


def chat_chunk(
    context: ResponseContext,
    completion: Completion,
    cursor: ChoiceCursor,
    *,
    role: str = "assistant",
) -> dict[str, Any] | None:
    """The chunk for what is new in one choice; the first also carries the role."""
    text, tokens = cursor.advance(completion)
    finished = completion.finish_reason is not None
    if not text and tokens.start == tokens.stop and not finished and cursor.started:
        return None
    delta: dict[str, Any] = {}
    if not cursor.started:
        delta["role"] = role
    if text or not cursor.started:
        delta["content"] = text
    choice: dict[str, Any] = {
        "index": completion.index,
        "delta": delta,
        "logprobs": _chat_logprobs(context, completion, tokens),
        "finish_reason": _finish_reason(completion.finish_reason),
        "stop_reason": completion.stop_reason,
    }
    if context.return_token_ids:
        choice["token_ids"] = list(completion.token_ids[tokens])
    cursor.started = True
    cursor.finished = finished
    return _chunk(context, "chat.completion.chunk", choice)


def _chat_logprobs(
    context: ResponseContext, completion: Completion, tokens: slice
) -> dict[str, Any] | None:
    if context.num_logprobs is None or completion.logprobs is None:
        return None
    content = []
    for token_id, entries in zip(
        completion.token_ids[tokens], completion.logprobs[tokens], strict=True
    ):
        token = _token_string(context, token_id, entries.get(token_id))
        content.append(
            {
                "token": token,
                "logprob": _logprob_value(entries.get(token_id)),
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {
                        "token": (top := _token_string(context, other, entry)),
                        "logprob": _logprob_value(entry),
                        "bytes": list(top.encode()),
                    }
                    for other, entry in _ranked(entries, context.num_logprobs, keep=None)
                ],
            }
        )
    return {"content": content}


# ----------------------------------------------------------------------------- helpers
def usage_chunk(
    context: ResponseContext, object_name: str, outputs: Sequence[RequestOutput]
) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    return {
        "id": context.response_id,
        "object": object_name,
        "created": context.created,
        "model": context.model,
        "choices": [],
        "usage": usage(outputs),
    }


def _chunk(context: ResponseContext, object_name: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": context.response_id,
        "object": object_name,
        "created": context.created,
        "model": context.model,
        "choices": [choice],
    }


def _finish_reason(reason: str | None) -> str | None:
    return reason


def _ranked(entries: Mapping[int, Any], limit: int, *, keep: int | None) -> list[tuple[int, Any]]:
    """The top-``limit`` entries by rank, plus ``keep`` (the sampled token) if given."""
    ranked = sorted(entries.items(), key=lambda item: _rank(item[1]))
    return [
        (token_id, entry) for token_id, entry in ranked if _rank(entry) <= limit or token_id == keep
    ]


def _rank(entry: Any) -> int:
    rank = getattr(entry, "rank", None)
    return rank if isinstance(rank, int) else 0


def _logprob_value(entry: Any) -> float:
    value = float(getattr(entry, "logprob", entry if entry is not None else _MIN_LOGPROB))
    return value if math.isfinite(value) else _MIN_LOGPROB


def _token_string(context: ResponseContext, token_id: int, entry: Any) -> str:
    decoded = getattr(entry, "decoded_token", None)
    return decoded if isinstance(decoded, str) else context.token_text(token_id)
