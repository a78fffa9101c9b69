"""Request fields the server knows but does not implement, and what it does with them.

No field is dropped silently. Every field of a request body is one of:

* **implemented**: a field of the request models in :mod:`pagedinfer.serving.protocol`;
* **unsupported** (:data:`UNSUPPORTED`): OpenAI's or vLLM's, with a feature pagedinfer lacks
  (watermarking, OpenAI's deprecated ``functions``, ...). A value that asks for
  nothing (``null``, ``false``, ``[]``, the default) is accepted; anything else is a 400
  naming the field;
* **ignored** (:data:`IGNORED`): fields that only describe the request for the caller's own
  bookkeeping (``user``, ``metadata``, ``store``, ...): accepted, without effect, and the
  server logs a warning the first time it sees each (once per field, not per request);
* **unknown**: anything else. A 400 ``Unrecognized request argument supplied: <name>``, as
  OpenAI answers (a typo is caught, not ignored); with
  ``ServingOptions(ignore_unknown_fields=True)`` (``--ignore-unknown-fields``) a logged
  warning instead, as vLLM does.

The tables name fields per endpoint (:data:`COMPLETIONS`, :data:`CHAT`, :data:`TOKENIZE`,
:data:`RESPONSES`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedinfer.errors import InvalidRequestError

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "IGNORED",
    "RESPONSES",
    "TOKENIZE_CHAT",
    "TOKENIZE_COMPLETION",
    "UNSUPPORTED",
    "FieldPolicy",
    "RequestFieldError",
    "Unsupported",
    "names",
]

logger = logging.getLogger("pagedinfer.serving")


class RequestFieldError(InvalidRequestError):
    """A request field the server cannot serve (400); ``param`` names it for the error
    JSON."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A field pagedinfer does not implement: ``harmless(value)`` says whether a value asks
    for nothing (then it is accepted); ``reason`` completes "<field> is not supported: ..."."""

    harmless: Callable[[Any], bool]
    reason: str


def _is(*values: Any) -> Callable[[Any], bool]:
    """Harmless when null or equal to one of ``values`` (type included: ``0`` is not
    ``False``)."""

    def harmless(value: Any) -> bool:
        return value is None or any(
            type(value) is type(allowed) and value == allowed for allowed in values
        )

    return harmless


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (list, dict)) and not value)


def _number(expected: float) -> Callable[[Any], bool]:
    def harmless(value: Any) -> bool:
        return value is None or (
            isinstance(value, (int, float)) and not isinstance(value, bool) and value == expected
        )

    return harmless


_FUNCTIONS = "OpenAI's deprecated functions API is not served: send tools and tool_choice instead"
_NO_MULTIMODAL = "pagedinfer serves text-only models"


def _text_modalities(value: Any) -> bool:
    return value is None or value == ["text"]


# Fields of both endpoints (OpenAI's, then vLLM's).
_COMMON: dict[str, Unsupported] = {
    "early_stopping": Unsupported(
        _is(False), "beam search runs until every beam ends or max_tokens (vLLM's rule)"
    ),
    "watermarking": Unsupported(_is(False), "watermarking is not implemented"),
    "bad_words": Unsupported(_empty, "bad-word filtering is not implemented"),
    "logprob_token_ids": Unsupported(
        _empty, "logprobs of chosen token ids are not implemented (use logprobs)"
    ),
    "logits_processors": Unsupported(_empty, "custom logits processors cannot be loaded"),
    "priority": Unsupported(
        _number(0), "requests are scheduled first come, first served (no priorities)"
    ),
    "cache_salt": Unsupported(
        _empty, "the prefix cache is shared by every request (no per-tenant salt)"
    ),
    "kv_transfer_params": Unsupported(_empty, "disaggregated prefill is not implemented"),
    "ec_transfer_params": Unsupported(_empty, "disaggregated encoding is not implemented"),
    "vllm_xargs": Unsupported(_empty, "custom extension arguments are not implemented"),
    "repetition_detection": Unsupported(_empty, "repetition detection is not implemented"),
    "thinking_token_budget": Unsupported(_number(-1), "thinking budgets are not implemented"),
    "spaces_between_special_tokens": Unsupported(
        _is(True), "special tokens are always decoded as the tokenizer joins them"
    ),
    "mm_processor_kwargs": Unsupported(_empty, _NO_MULTIMODAL),
    "media_io_kwargs": Unsupported(_empty, _NO_MULTIMODAL),
}

_COMPLETIONS_ONLY: dict[str, Unsupported] = {
    "suffix": Unsupported(_is(""), "insertion (fill in the middle) needs a model trained for it"),
    "prompt_embeds": Unsupported(_empty, "prompts are text or token ids (no embeddings)"),
}

_CHAT_ONLY: dict[str, Unsupported] = {
    "use_beam_search": Unsupported(
        _is(False), "beam search is served on /v1/completions only (use_beam_search there)"
    ),
    "length_penalty": Unsupported(
        _number(1.0), "it applies to beam search, served on /v1/completions only"
    ),
    "functions": Unsupported(_empty, _FUNCTIONS),
    "function_call": Unsupported(
        _is("none", "auto"), _FUNCTIONS + ' ("none" and "auto" are accepted)'
    ),
    "audio": Unsupported(_is(), _NO_MULTIMODAL),
    "modalities": Unsupported(_text_modalities, _NO_MULTIMODAL + ' (["text"] is accepted)'),
    "prediction": Unsupported(_is(), "predicted outputs are not implemented"),
    "web_search_options": Unsupported(_is(), "there is no web search"),
    "verbosity": Unsupported(_empty, "verbosity hints are not implemented"),
    "moderation": Unsupported(_is(), "there is no moderation"),
}

# /v1/responses: OpenAI's fields of features the server lacks, and vLLM's extensions there.
_RESPONSES_ONLY: dict[str, Unsupported] = {
    "background": Unsupported(_is(False), "responses run while the request waits (no background)"),
    "include": Unsupported(_empty, "no extra output data can be included"),
    "conversation": Unsupported(
        _is(), "there are no stored conversations (send previous_response_id, or the history)"
    ),
    "prompt": Unsupported(_is(), "there are no stored prompt templates"),
    "max_tool_calls": Unsupported(_is(), "the number of tool calls is not limited"),
    "top_logprobs": Unsupported(_number(0), "logprobs are not served on /v1/responses"),
    "truncation": Unsupported(
        _is("disabled"), 'an input too long is refused, never truncated ("disabled" is accepted)'
    ),
    "background_options": Unsupported(_is(), "it applies to background, not implemented"),
    "context_management": Unsupported(_empty, "context compaction is not implemented"),
    "access_programs": Unsupported(_is(), "programmatic tool calling is not implemented"),
    "image": Unsupported(_is(), _NO_MULTIMODAL),
    "moderation": Unsupported(_is(), "there is no moderation"),
    "priority": _COMMON["priority"],
    "cache_salt": _COMMON["cache_salt"],
    "mm_processor_kwargs": _COMMON["mm_processor_kwargs"],
}

UNSUPPORTED: dict[str, dict[str, Unsupported]] = {
    "completions": {**_COMMON, **_COMPLETIONS_ONLY},
    "chat": {**_COMMON, **_CHAT_ONLY},
    "responses": _RESPONSES_ONLY,
    "tokenize_completion": {},
    "tokenize_chat": {
        "mm_processor_kwargs": _COMMON["mm_processor_kwargs"],
        "media_io_kwargs": _COMMON["media_io_kwargs"],
    },
}
COMPLETIONS = "completions"
CHAT = "chat"
TOKENIZE_COMPLETION = "tokenize_completion"
TOKENIZE_CHAT = "tokenize_chat"
RESPONSES = "responses"

# Fields that describe the request for the caller (or hint at a cadence or cache placement
# without changing any output): accepted and ignored, with one logged warning per field.
IGNORED: dict[str, frozenset[str]] = {
    "completions": frozenset(
        {
            "user",
            "metadata",
            "store",
            "service_tier",
            "session_id",
            "prompt_cache_key",
            "prompt_cache_retention",
            "prompt_cache_options",
            "safety_identifier",
            "stream_interval",
            "return_token_offsets",
            "return_mm_kwargs",
            "routed_experts_prompt_start",
        }
    ),
}
IGNORED["chat"] = IGNORED["completions"]
IGNORED["responses"] = frozenset(
    {
        "user",
        "metadata",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
    }
)
IGNORED["tokenize_completion"] = frozenset()
IGNORED["tokenize_chat"] = frozenset()
# Inside stream_options.
IGNORED_STREAM_OPTIONS = frozenset({"include_obfuscation"})


@dataclass
class FieldPolicy:
    """Checks the fields a request model did not declare (its ``model_extra``); one per
    server (it remembers which ignored fields it has warned about)."""

    ignore_unknown: bool = False
    _warned: set[str] = field(default_factory=set)

    def check(self, endpoint: str, extra: Mapping[str, Any] | None, prefix: str = "") -> None:
        """Raise :class:`RequestFieldError` for the first field that cannot be served; warn
        (once per field) about the ignored ones."""
        if not extra:
            return
        unsupported = UNSUPPORTED[endpoint]
        ignored = IGNORED[endpoint] if not prefix else IGNORED_STREAM_OPTIONS
        for name, value in extra.items():
            shown = prefix + name
            rule = None if prefix else unsupported.get(name)
            if rule is not None:
                if not rule.harmless(value):
                    raise RequestFieldError(
                        shown, f"{shown} is not supported: {rule.reason}. Leave it out."
                    )
            elif name in ignored:
                self._warn(shown, "it only describes the request; it changes nothing here")
            elif self.ignore_unknown:
                self._warn(shown, "this server does not know it (--ignore-unknown-fields)")
            else:
                raise RequestFieldError(
                    shown,
                    f"Unrecognized request argument supplied: {shown}. Remove it, or check "
                    "its spelling (docs/serving.md lists the parameters this server accepts).",
                )

    def _warn(self, name: str, why: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            logger.warning(
                "request field %r is accepted and ignored: %s (logged once per field)", name, why
            )


def names(endpoint: str) -> Iterable[str]:
    """Every field name the tables know for ``endpoint`` (for documentation and tests)."""
    return sorted({*UNSUPPORTED[endpoint], *IGNORED[endpoint]})
