"""Speculative decoding: its configuration, the n-gram proposer and the acceptance rule.

A *proposer* guesses up to ``k`` tokens that follow a sequence (*drafts*); the next step
computes the sequence's last token and its drafts in one row of ``1 + k`` query tokens (a
*verify row*) and samples every one of them. Sample ``i`` is the target model's token after
the last token and drafts ``0..i-1``, drawn with exactly the parameters (and, for seeded
requests, exactly the noise) that non-speculative decoding would use at that position. The
drafts are accepted while they equal those samples (:func:`accepted_length`); the sequence
then gets the accepted drafts plus the first sample that differs (or the bonus sample after
the last draft), so one verify row yields 1 to ``k + 1`` tokens.

The proposers here are deterministic (the n-gram lookup, and the draft model's greedy
tokens), so the proposal distribution ``q`` is a point mass on the draft. Rejection
sampling (accept with ``min(1, p/q)``, else resample from ``max(0, p - q)`` normalized)
then reads: accept draft ``d`` with probability ``p(d)``, else draw from ``p`` without
``d``. Drawing ``x ~ p`` and accepting when ``x == d`` does exactly that (``x`` is then the
resample), so the output distribution is the target's, and a seeded request draws the same
tokens with and without speculation (docs/speculative-decoding.md).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from pagedinfer.errors import ConfigurationError

__all__ = [
    "SPECULATIVE_METHODS",
    "SpeculativeConfig",
    "SpeculativeMethod",
    "accepted_length",
    "propose_ngram",
]

SpeculativeMethod = Literal["ngram", "draft_model"]
SPECULATIVE_METHODS: tuple[SpeculativeMethod, ...] = get_args(SpeculativeMethod)
_KEYS = frozenset(
    {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: ``method`` ``"ngram"`` (prompt lookup: the tokens that
    followed the latest earlier occurrence of the sequence's last ``n`` tokens, ``n`` from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``) or ``"draft_model"`` (a smaller
    checkpoint ``model`` with the same tokenizer, decoding greedily); ``num_speculative_tokens``
    drafts per step (``k``)."""

    method: SpeculativeMethod
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigurationError(
                f"speculative_config method={self.method!r} is unknown: expected one of "
                f"{', '.join(repr(m) for m in SPECULATIVE_METHODS)}."
            )
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigurationError(
                f"speculative_config num_speculative_tokens={k!r} is invalid: expected an "
                f"integer in [1, {MAX_SPECULATIVE_TOKENS}] (the drafts verified per step)."
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (_is_int(low) and _is_int(high) and 1 <= low <= high):
            raise ConfigurationError(
                f"speculative_config prompt_lookup_min={low!r}, prompt_lookup_max={high!r} "
                "are invalid: expected integers with 1 <= prompt_lookup_min <= "
                "prompt_lookup_max (the n-gram lengths the lookup tries)."
            )
        if self.method == "draft_model" and not self.model:
            raise ConfigurationError(
                "speculative_config method='draft_model' needs 'model': the directory of a "
                "smaller checkpoint with the target's tokenizer."
            )
        if self.method == "ngram" and self.model is not None:
            raise ConfigurationError(
                "speculative_config method='ngram' takes no 'model' (it looks drafts up in "
                "the sequence itself): drop 'model', or use method='draft_model'."
            )

    @classmethod
    def from_value(cls, value: SpeculativeConfig | Mapping[str, object]) -> SpeculativeConfig:
        """From vLLM's dict form (``{"method": "ngram", "num_speculative_tokens": 3}``); a
        dict with ``model`` and no ``method`` means a draft model, as in vLLM."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ConfigurationError(
                f"speculative_config={value!r} is invalid: expected a dict such as "
                "{'method': 'ngram', 'num_speculative_tokens': 3}."
            )
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ConfigurationError(
                f"speculative_config keys {unknown} are not supported: expected some of "
                f"{sorted(_KEYS)}."
            )
        method = value.get("method")
        if method is None:
            method = "draft_model" if value.get("model") is not None else None
        if "num_speculative_tokens" not in value or method is None:
            raise ConfigurationError(
                "speculative_config needs 'method' ('ngram' or 'draft_model') and "
                "'num_speculative_tokens'."
            )
        model = value.get("model")
        return cls(
            method=method,  # type: ignore[arg-type]  # checked in __post_init__
            num_speculative_tokens=value["num_speculative_tokens"],  # type: ignore[arg-type]
            prompt_lookup_max=value.get("prompt_lookup_max", 4),  # type: ignore[arg-type]
            prompt_lookup_min=value.get("prompt_lookup_min", 1),  # type: ignore[arg-type]
            model=None if model is None else str(model),
        )

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """The n-gram proposer's drafts for ``token_ids`` (at most ``max_drafts``)."""
        return propose_ngram(
            token_ids,
            min(self.num_speculative_tokens, max_drafts),
            self.prompt_lookup_min,
            self.prompt_lookup_max,
        )


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """``k`` tokens that followed the latest earlier occurrence of the last ``n`` tokens, for
    the largest ``n`` in ``[min_n, max_n]`` that occurs earlier; ``[]`` if none. An occurrence
    close to the end continues into the tokens it proposes, so a loop of any period yields
    ``k`` drafts (``[7, 8, 7, 8, 7]`` proposes ``8, 7, 8...``).

    The search runs over the history's bytes (``bytes.rfind``, in C), so a long history costs
    microseconds, not a Python loop per token."""
    length = len(token_ids)
    if k <= 0 or length < 2:
        return []
    tokens = array("q", token_ids)
    history = tokens.tobytes()
    width = tokens.itemsize  # bytes per token
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = history[(length - n) * width :]
        # An occurrence that ends before the last token (so a token follows it).
        stop = (length - 1) * width
        while True:
            found = history.rfind(pattern, 0, stop)
            if found < 0:
                break
            if found % width == 0:  # aligned on a token
                end = found // width + n
                drafts: list[int] = []
                for index in range(end, end + k):
                    drafts.append(token_ids[index] if index < length else drafts[index - length])
                return drafts
            stop = found + len(pattern) - 1  # a misaligned match: look further back
    return []


def accepted_length(samples: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts equal the samples drawn after them (``len(samples) ==
    len(drafts) + 1``: the last sample follows the last draft)."""
    for index, draft in enumerate(drafts):
        if samples[index] != draft:
            return index
    return len(drafts)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
