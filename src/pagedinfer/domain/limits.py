"""Request limits: bounds on what one request may ask for, checked before any work grows with it.

A request's cost grows with some of its sizes: ``n`` sequences are built and scheduled, the
top ``logprobs`` tokens are gathered and decoded for every token, stop strings are searched
in every completion's text each step, token-id lists become per-request rows on the device.
:meth:`RequestLimits.check` looks at those sizes first, in time independent of their values
(``len()`` and comparisons), so a request asking for ``n=10**8`` or a million stop strings is
refused at once instead of after the work it asks for. The engine then runs its other checks
(token ids in range, ...), whose cost is bounded by these limits.

Names follow vLLM where it has one (``max_logprobs``, default 20; -1 means the vocabulary);
``max_n`` defaults to OpenAI's cap on ``n`` (128). ``Engine`` takes each as a keyword
argument and ``pagedinfer serve`` / ``generate`` as a flag (``--max-n``, ...); the engine's
resolved limits are :attr:`pagedinfer.Engine.request_limits`.

Pure Python (the domain layer): the server reads these to refuse a request before it is
parsed further.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.errors import ConfigurationError, InvalidRequestError

__all__ = [
    "DEFAULT_MAX_LOGPROBS",
    "DEFAULT_MAX_MODEL_LEN",
    "DEFAULT_MAX_N",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "DEFAULT_MAX_STOP",
    "DEFAULT_MAX_STOP_STR_LEN",
    "RequestLimits",
    "max_running",
]

# The engine's sizes by default (``Engine``'s keywords, the runner's and the command line's).
DEFAULT_MAX_NUM_SEQS = 512
DEFAULT_MAX_NUM_BATCHED_TOKENS = 16384
DEFAULT_MAX_MODEL_LEN = 4096
"""``max_model_len`` when none is given, unless the model's limit is lower: small enough that
the KV cache of one sequence fits a CPU's memory (vLLM's default is the model's whole
context, 40,960 tokens for Qwen3, which a CPU cache of float32 KV would spend gigabytes on)."""


def max_running(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most sequences that run at once: every running sequence must fit in one decode
    step (one token each), or some would starve."""
    return min(max_num_seqs, max_num_batched_tokens)


DEFAULT_MAX_N = 128
DEFAULT_MAX_LOGPROBS = 20
DEFAULT_MAX_STOP = 64
DEFAULT_MAX_STOP_STR_LEN = 1024

# How each limit is raised, for the error messages: (keyword argument, command-line flag).
_RAISE = {
    "max_n": ("max_n", "--max-n"),
    "max_logprobs": ("max_logprobs", "--max-logprobs"),
    "max_stop": ("max_stop", "--max-stop"),
    "max_stop_str_len": ("max_stop_str_len", "--max-stop-str-len"),
}


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The most one request may ask for (a frozen value; ``Engine.request_limits``).

    ``max_n``: completions per request (``SamplingParams.n``); the engine also caps ``n`` at
    what runs at once, ``min(max_num_seqs, max_num_batched_tokens)``.
    ``max_logprobs``: the most top log-probabilities per token, for ``logprobs`` and
    ``prompt_logprobs`` alike (vLLM's name and default, 20; -1: the whole vocabulary).
    ``max_stop``: stop strings per request; ``max_stop_str_len``: characters per stop string.
    Token-id lists (``stop_token_ids``, ``allowed_token_ids``, ``logit_bias``) may name each
    token of the vocabulary at most once, so the engine bounds them by its size.
    """

    max_n: int = DEFAULT_MAX_N
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_stop: int = DEFAULT_MAX_STOP
    max_stop_str_len: int = DEFAULT_MAX_STOP_STR_LEN

    def __post_init__(self) -> None:
        for name in ("max_n", "max_stop", "max_stop_str_len"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigurationError(f"{name}={value!r} is invalid: expected an integer >= 1.")
        if not _is_int(self.max_logprobs) or self.max_logprobs < -1:
            raise ConfigurationError(
                f"max_logprobs={self.max_logprobs!r} is invalid: expected an integer >= 0, "
                "or -1 for the whole vocabulary."
            )

    def max_logprobs_for(self, vocab_size: int) -> int:
        """``max_logprobs`` with -1 resolved to ``vocab_size``."""
        return vocab_size if self.max_logprobs == -1 else self.max_logprobs

    def check(self, params: SamplingParams, *, vocab_size: int) -> None:
        """Raise :class:`InvalidRequestError` if ``params`` asks for more than these limits
        (or names more token ids than the vocabulary has). Costs ``O(max_stop)`` at most:
        sizes are compared before anything is iterated."""
        if params.n > self.max_n:
            _refuse("n", params.n, "max_n", self.max_n, "ask for fewer completions")
        max_logprobs = self.max_logprobs_for(vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                _refuse(name, value, "max_logprobs", max_logprobs, "ask for fewer")
        if len(params.stop) > self.max_stop:
            _refuse("stop", f"<{len(params.stop)} strings>", "max_stop", self.max_stop, "")
        longest = max((len(text) for text in params.stop), default=0)
        if longest > self.max_stop_str_len:
            _refuse(
                "stop",
                f"<a string of {longest} characters>",
                "max_stop_str_len",
                self.max_stop_str_len,
                "use shorter stop strings",
            )
        sizes = (
            ("stop_token_ids", len(params.stop_token_ids)),
            ("allowed_token_ids", len(params.allowed_token_ids or ())),
            ("logit_bias", len(params.logit_bias or ())),
        )
        for name, size in sizes:
            if size > vocab_size:
                raise InvalidRequestError(
                    f"SamplingParams.{name} has {size} entries but the model's vocabulary has "
                    f"{vocab_size} tokens: name each token id at most once."
                )


def _refuse(field: str, value: object, limit: str, bound: int, advice: str) -> NoReturn:
    keyword, flag = _RAISE[limit]
    shown = value if isinstance(value, str) else repr(value)
    advice = f"{advice}, or " if advice else ""
    raise InvalidRequestError(
        f"SamplingParams.{field}={shown} exceeds {limit}={bound}: {advice}raise the limit "
        f"(Engine({keyword}=...), command line {flag})."
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
