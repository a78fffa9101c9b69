"""Engine outputs to OpenAI response bodies: completions, chat completions, stream chunks.

This is the one module that reads the engine's output objects (:func:`completions_of`);
everything else in the server works on :class:`Completion` views, so a change of the
engine's output shape is one edit here. Bodies are plain dicts (serialized once with
``json.dumps``): a streamed token costs one small dict, not a pydantic model.

Choices are numbered as OpenAI and vLLM do: with several prompts and ``n`` completions each,
choice ``prompt_index * n + completion_index``. Streams cut each choice's deltas from the
cumulative outputs with a :class:`ChoiceCursor`; a choice's last chunk carries its
``finish_reason`` (once, even when other choices of the request run on).

The optional fields vLLM's responses carry (``token_ids``, ``prompt_token_ids``,
``prompt_logprobs``, ``stop_reason``, ``system_fingerprint``, a chat message's ``refusal``,
``reasoning``, ...) are present as ``null`` when not asked for, as vLLM sends them: a client
written against vLLM reads them as attributes of the ``openai`` client's objects.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.serving.reasoning import ReasoningParser, ReasoningStream
from pagedinfer.serving.tools import ToolCalls, ToolCallStream

__all__ = [
    "ChoiceCursor",
    "Completion",
    "Prompt",
    "ResponseContext",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "completions_of",
    "prompt_of",
    "sse",
    "usage",
    "usage_chunk",
]

# Token strings of return_tokens_as_token_ids (vLLM's form).
_TOKEN_ID_PREFIX = "token_id:"

# JSON has no -inf: a token the model rules out gets vLLM's stand-in.
_MIN_LOGPROB = -9999.0

TokenText = Callable[[int], str]
DecodeText = Callable[[Sequence[int]], str]
# (token id, {token id: Logprob} or None) per token a logprobs block describes.
TokenEntries = list[tuple[int, Mapping[int, Any] | None]]


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


@dataclass(frozen=True, slots=True)
class Prompt:
    """The prompt of one engine output, as the server needs it."""

    text: str | None  # None for token-id prompts
    token_ids: Sequence[int]
    # Per prompt token, {token_id: Logprob} (None for the first); None unless asked for.
    logprobs: Sequence[Mapping[int, Any] | None] | None
    num_cached_tokens: int = 0  # served by the prefix cache


def prompt_of(output: RequestOutput) -> Prompt:
    """The prompt of one engine output (the only other place that knows its shape)."""
    return Prompt(
        text=output.prompt,
        token_ids=output.prompt_token_ids,
        logprobs=output.prompt_logprobs,
        num_cached_tokens=output.num_cached_tokens,
    )


@dataclass(frozen=True, slots=True)
class ResponseContext:
    """What every body of one response shares."""

    response_id: str
    model: str
    created: int
    token_text: TokenText  # decodes one token id (logprobs entries without decoded text)
    num_logprobs: int | None  # top log-probabilities per token; None: none asked for
    return_token_ids: bool = False
    decode: DecodeText | None = None  # decodes a prompt given as token ids (echo)
    # Completions: the prompt's text (and logprobs) come before each choice's own.
    echo: bool = False
    # echo with max_tokens=0: the prompt alone (the one token generated is dropped).
    echo_only: bool = False
    # vLLM's prompt_logprobs extension: {token_id: {logprob, rank, decoded_token}} per token.
    prompt_logprobs: bool = False
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>".
    tokens_as_ids: bool = False
    # stream_options.continuous_usage_stats: every chunk carries the usage so far.
    continuous_usage: bool = False
    # --enable-prompt-tokens-details: usage carries prompt_tokens_details.cached_tokens.
    prompt_tokens_details: bool = False
    # stream_options.min_characters: a choice's deltas are held until this many characters.
    min_characters: int = 0
    # Chat: the answer's role, what echo puts before it, whether the rendered prompt is sent.
    role: str = "assistant"
    echo_text: str = ""
    prompt_text: bool = False
    # Chat with tools: how the answer's tool calls are read (None: the answer is text).
    tool_calls: ToolCalls | None = None
    # Chat with --reasoning-parser: how the answer's reasoning is read (None: no parser),
    # whether the answer starts in reasoning, whether the reasoning is sent.
    reasoning: ReasoningParser | None = None
    thinking: bool = True
    include_reasoning: bool = True

    def reasoning_stream(self) -> ReasoningStream | None:
        """A chat choice's reasoning stream (``None`` without a parser)."""
        if self.reasoning is None:
            return None
        return self.reasoning.stream(thinking=self.thinking, end_texts=self._end_texts())

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        """A finished chat answer's reasoning (``None``: none, or not sent) and content."""
        if self.reasoning is None:
            return None, text
        split = self.reasoning.split(text, thinking=self.thinking, end_texts=self._end_texts())
        return (split.reasoning if self.include_reasoning else None), split.content

    def _end_texts(self) -> tuple[str, ...]:
        return self.tool_calls.end_texts if self.tool_calls is not None else ()


class ChoiceCursor:
    """How much of one choice a stream has sent; cuts the next delta from a cumulative view.

    The engine's cumulative text only ever grows (text that could still turn out to start a
    stop string is held back until it cannot), so a delta is a plain slice.
    """

    __slots__ = (
        "chars",
        "finished",
        "held",
        "reasoning",
        "started",
        "text_offset",
        "tokens",
        "tools",
    )

    def __init__(self) -> None:
        self.tools: ToolCallStream | None = None  # a chat choice whose tool calls are read
        self.reasoning: ReasoningStream | None = None  # a chat choice whose reasoning is read
        self.tokens = 0
        self.chars = 0
        # Where the next token's logprobs entry starts: the lengths of the token strings
        # sent so far (echoed prompt tokens included), as in a whole response.
        self.text_offset = 0
        self.started = False
        self.finished = False
        self.held = False  # the last advance held its text back (min_characters)

    def advance(self, completion: Completion, min_characters: int = 0) -> tuple[str, slice]:
        """The text and the token range that are new since the previous call; nothing
        (``held`` is set) while fewer than ``min_characters`` characters are new and the
        completion goes on."""
        text = completion.text[self.chars :]
        self.held = len(text) < min_characters and completion.finish_reason is None
        if self.held:
            return "", slice(self.tokens, self.tokens)
        tokens = slice(self.tokens, len(completion.token_ids))
        self.chars = len(completion.text)
        self.tokens = len(completion.token_ids)
        return text, tokens


def usage(
    outputs: Sequence[RequestOutput], *, echo_only: bool = False, details: bool = False
) -> dict[str, Any]:
    """Token counts: each prompt once (however many completions it has), every completion's
    generated tokens (none when only the prompt is echoed), and with ``details`` (the
    server's ``--enable-prompt-tokens-details``, as vLLM's) the prompt tokens the prefix
    cache served (``prompt_tokens_details.cached_tokens``)."""
    prompts = [prompt_of(output) for output in outputs]
    completion_tokens = 0
    if not echo_only:
        completion_tokens = sum(
            len(completion.token_ids) for output in outputs for completion in completions_of(output)
        )
    cached = sum(prompt.num_cached_tokens for prompt in prompts) if details else None
    return _usage(sum(len(prompt.token_ids) for prompt in prompts), completion_tokens, cached)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    counts: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts


def _running_usage(context: ResponseContext, prompt: Prompt, num_tokens: int) -> dict[str, Any]:
    """One choice's usage so far (``continuous_usage_stats``): its prompt, its tokens."""
    generated = 0 if context.echo_only else num_tokens
    cached = prompt.num_cached_tokens if context.prompt_tokens_details else None
    return _usage(len(prompt.token_ids), generated, cached)


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
        prompt = prompt_of(output)
        for completion in completions_of(output):
            text, entries = completion.text, _entries(completion, slice(None))
            if context.echo_only:
                text, entries = "", []
            if context.echo:
                text = _prompt_text(context, prompt) + text
                entries = _prompt_entries(prompt) + entries
            choice: dict[str, Any] = {
                "index": prompt_index * n + completion.index,
                "text": text,
                "logprobs": _completion_logprobs(context, entries, 0)[0],
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
            }
            if context.prompt_logprobs:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(context, prompt)
            if context.return_token_ids:
                choice["token_ids"] = [] if context.echo_only else list(completion.token_ids)
                choice["prompt_token_ids"] = list(prompt.token_ids)
            choices.append(choice)
    choices.sort(key=lambda choice: choice["index"])
    return {
        "id": context.response_id,
        "object": "text_completion",
        "created": context.created,
        "model": context.model,
        "choices": choices,
        "usage": usage(outputs, echo_only=context.echo_only, details=context.prompt_tokens_details),
        "system_fingerprint": None,
        "service_tier": None,
    }


def completion_chunk(
    context: ResponseContext,
    index: int,
    completion: Completion,
    cursor: ChoiceCursor,
    prompt: Prompt,
) -> dict[str, Any] | None:
    """The chunk for what is new in one choice; None when nothing is (or it has ended)."""
    if cursor.finished:
        return None
    text, new = cursor.advance(completion, context.min_characters)
    if context.echo_only:
        text, new = "", slice(new.stop, new.stop)
    entries = _entries(completion, new) if context.num_logprobs is not None else []
    finished = completion.finish_reason is not None
    if context.echo and not cursor.started:
        text = _prompt_text(context, prompt) + text
        entries = _prompt_entries(prompt) + entries
    elif not text and new.start == new.stop and not finished:
        return None
    logprobs, cursor.text_offset = _completion_logprobs(context, entries, cursor.text_offset)
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "token_ids": None,
        "prompt_token_ids": None,
    }
    if context.return_token_ids:
        choice["token_ids"] = list(completion.token_ids[new])
        if not cursor.started:
            choice["prompt_token_ids"] = list(prompt.token_ids)
    cursor.started = True
    cursor.finished = finished
    chunk = _chunk(context, "text_completion", choice)
    if context.continuous_usage:
        chunk["usage"] = _running_usage(context, prompt, len(completion.token_ids))
    return chunk


def _entries(completion: Completion, tokens: slice) -> TokenEntries:
    token_ids = completion.token_ids[tokens]
    if completion.logprobs is None:
        return [(token_id, None) for token_id in token_ids]
    return list(zip(token_ids, completion.logprobs[tokens], strict=True))


def _prompt_text(context: ResponseContext, prompt: Prompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return context.decode(prompt.token_ids) if context.decode is not None else ""


def _prompt_entries(prompt: Prompt) -> TokenEntries:
    logprobs = prompt.logprobs or [None] * len(prompt.token_ids)
    return list(zip(prompt.token_ids, logprobs, strict=True))


def _completion_logprobs(
    context: ResponseContext, entries: TokenEntries, text_offset: int
) -> tuple[dict[str, Any] | None, int]:
    """OpenAI's completions logprobs, and the offset after them: per token its text, its
    logprob, the top logprobs by text (the sampled token's too), its offset in the choice's
    text (the lengths of the tokens' texts before it, as vLLM counts). A token nothing
    predicts (the first prompt token, echoed) has ``null`` logprob and top logprobs."""
    limit = context.num_logprobs
    if limit is None:
        return None, text_offset
    token_strings: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, ranked in entries:
        entry = ranked.get(token_id) if ranked is not None else None
        token = _token_string(context, token_id, entry)
        token_strings.append(token)
        if ranked is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token_logprobs.append(_logprob_value(entry))
            top_logprobs.append(
                {
                    _token_string(context, other, top): _logprob_value(top)
                    for other, top in _ranked(ranked, limit, keep=token_id)
                }
            )
        offsets.append(text_offset)
        text_offset += len(token)
    logprobs = {
        "tokens": token_strings,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
    return logprobs, text_offset


def _vllm_prompt_logprobs(context: ResponseContext, prompt: Prompt) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt token ``{token_id: {logprob, rank,
    decoded_token}}`` (``null`` for the first)."""
    if prompt.logprobs is None:
        return None
    return [
        None
        if ranked is None
        else {
            str(token_id): {
                "logprob": _logprob_value(entry),
                "rank": getattr(entry, "rank", None),
                "decoded_token": _token_text(context, token_id, entry),
            }
            for token_id, entry in ranked.items()
        }
        for ranked in prompt.logprobs
    ]


# -------------------------------------------------------------------------------- chat
def chat_response(context: ResponseContext, output: RequestOutput) -> dict[str, Any]:
    prompt = prompt_of(output)
    choices = []
    for completion in completions_of(output):
        finish_reason = completion.finish_reason
        tools = context.tool_calls
        reasoning, text = context.split_reasoning(completion.text)
        if tools is None:
            content: str | None = context.echo_text + text
            if context.reasoning is not None and not content:
                content = None  # vLLM's: an answer that only reasons has no content
            message = _message(context, content, reasoning)
        else:
            extracted = tools.extract(text)
            message = _message(
                context, context.echo_text + (extracted.content or "") or None, reasoning
            )
            if extracted.calls:
                message["tool_calls"] = [
                    {
                        "id": tools.format.new_id(),
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                    for call in extracted.calls
                ]
            finish_reason = tools.finish_reason(finish_reason, bool(extracted.calls))
        choice: dict[str, Any] = {
            "index": completion.index,
            "message": message,
            "logprobs": _chat_logprobs(context, completion, slice(0, len(completion.token_ids))),
            "finish_reason": finish_reason,
            "stop_reason": completion.stop_reason,
            "token_ids": list(completion.token_ids) if context.return_token_ids else None,
        }
        choices.append(choice)
    return {
        "id": context.response_id,
        "object": "chat.completion",
        "created": context.created,
        "model": context.model,
        "choices": choices,
        "usage": usage([output], details=context.prompt_tokens_details),
        "system_fingerprint": None,
        "service_tier": None,
        "prompt_logprobs": (
            _vllm_prompt_logprobs(context, prompt) if context.prompt_logprobs else None
        ),
        "prompt_token_ids": list(prompt.token_ids) if context.return_token_ids else None,
        "prompt_text": prompt.text if context.prompt_text else None,
    }


def _message(
    context: ResponseContext, content: str | None, reasoning: str | None = None
) -> dict[str, Any]:
    """A whole answer: its role and text (``None``: tool calls and no text), its reasoning
    (``reasoning_content``, and vLLM's newer name ``reasoning``), and (``null``) the fields
    the server never fills; ``tool_calls`` is added when the answer has some."""
    return {
        "role": context.role,
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": reasoning,
        "reasoning_content": reasoning,
    }


def chat_chunk(
    context: ResponseContext, completion: Completion, cursor: ChoiceCursor, prompt: Prompt
) -> dict[str, Any] | None:
    """The chunk for what is new in one choice; None when nothing is new (or the choice has
    ended). A choice's first chunk carries the role, what ``echo`` repeats, and (asked for)
    the prompt's token ids and rendered text."""
    if cursor.finished:
        return None
    text, tokens = cursor.advance(completion, context.min_characters)
    if cursor.held and cursor.started:
        return None
    finished = completion.finish_reason is not None
    finish_reason = completion.finish_reason
    tool_deltas: list[dict[str, Any]] = []
    tools = context.tool_calls
    answer = completion.text  # the answer after its reasoning (the parsers' input)
    reasoning = ""
    if context.reasoning is not None:
        if cursor.reasoning is None:
            cursor.reasoning = context.reasoning_stream()
        assert cursor.reasoning is not None
        step = cursor.reasoning.advance(completion.text, finished)
        answer, text = cursor.reasoning.content, step.content
        reasoning = step.reasoning if context.include_reasoning else ""
    if tools is not None:
        if cursor.tools is None:
            cursor.tools = tools.stream()
        text, tool_deltas = cursor.tools.advance(answer, finished)
        finish_reason = tools.finish_reason(finish_reason, cursor.tools.called)
    # Nothing new to show. (Tokens still owed a chunk for their logprobs or ids; with tool
    # calls or reasoning, tokens that only extend a held-back marker send nothing, as in
    # vLLM.)
    per_token = context.num_logprobs is not None or context.return_token_ids
    parsed = tools is not None or context.reasoning is not None
    quiet = tokens.start == tokens.stop or (parsed and not per_token)
    if not text and not tool_deltas and not reasoning and quiet and not finished and cursor.started:
        return None
    first = not cursor.started
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = context.role
        text = context.echo_text + text
    if reasoning:
        delta["reasoning"] = delta["reasoning_content"] = reasoning
    if text or first:
        delta["content"] = text
    if tool_deltas:
        delta["tool_calls"] = tool_deltas
    choice: dict[str, Any] = {
        "index": completion.index,
        "delta": delta,
        "logprobs": _chat_logprobs(context, completion, tokens),
        "finish_reason": finish_reason,
        "stop_reason": completion.stop_reason,
        "token_ids": list(completion.token_ids[tokens]) if context.return_token_ids else None,
    }
    cursor.started = True
    cursor.finished = finished
    chunk = _chunk(context, "chat.completion.chunk", choice)
    if first and context.return_token_ids:
        chunk["prompt_token_ids"] = list(prompt.token_ids)
    if first and context.prompt_text:
        chunk["prompt_text"] = prompt.text
    if context.continuous_usage:
        chunk["usage"] = _running_usage(context, prompt, len(completion.token_ids))
    return chunk


def _chat_logprobs(
    context: ResponseContext, completion: Completion, tokens: slice
) -> dict[str, Any] | None:
    if context.num_logprobs is None or completion.logprobs is None:
        return None
    content = []
    for token_id, entries in zip(
        completion.token_ids[tokens], completion.logprobs[tokens], strict=True
    ):
        entry = entries.get(token_id)
        content.append(
            {
                "token": _token_string(context, token_id, entry),
                "logprob": _logprob_value(entry),
                "bytes": _token_bytes(context, token_id, entry),
                "top_logprobs": [
                    {
                        "token": _token_string(context, other, top),
                        "logprob": _logprob_value(top),
                        "bytes": _token_bytes(context, other, top),
                    }
                    for other, top in _ranked(entries, context.num_logprobs, keep=None)
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
        "usage": usage(outputs, echo_only=context.echo_only, details=context.prompt_tokens_details),
    }


def _chunk(context: ResponseContext, object_name: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": context.response_id,
        "object": object_name,
        "created": context.created,
        "model": context.model,
        "choices": [choice],
    }


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
    """How logprobs name a token: its text, or ``token_id:<id>`` with vLLM's
    ``return_tokens_as_token_ids``."""
    if context.tokens_as_ids:
        return f"{_TOKEN_ID_PREFIX}{token_id}"
    return _token_text(context, token_id, entry)


def _token_text(context: ResponseContext, token_id: int, entry: Any) -> str:
    decoded = getattr(entry, "decoded_token", None)
    return decoded if isinstance(decoded, str) else context.token_text(token_id)


def _token_bytes(context: ResponseContext, token_id: int, entry: Any) -> list[int]:
    """A chat logprob's ``bytes``: the UTF-8 of the token's text (also when the token is
    named by its id)."""
    return list(_token_text(context, token_id, entry).encode())
