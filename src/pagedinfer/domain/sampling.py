"""Sampling parameters of one request: a frozen, validated value object."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NoReturn

from pagedinfer.errors import InvalidSamplingParamsError

__all__ = ["SamplingParams"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token, and when to stop.

    ``temperature=0`` is greedy decoding. ``top_k=0`` and ``top_p=1.0`` switch those filters
    off. ``stop`` holds stop strings (matched on the detokenized completion by the engine; the
    matched string is not part of the returned text); ``stop_token_ids`` finish a request when
    sampled (the token is kept in ``token_ids``). ``seed`` makes a request's samples
    reproducible regardless of what else is in the batch.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        # Lists are the natural thing to pass; store tuples so the value stays hashable.
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop, "stop")
        object.__setattr__(self, "stop", stop)
        self._validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def _validate(self) -> None:
        if not _is_real(self.temperature) or not math.isfinite(self.temperature):
            _fail("temperature", self.temperature, "a finite number >= 0 (0 means greedy)")
        if self.temperature < 0:
            _fail("temperature", self.temperature, "a finite number >= 0 (0 means greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            _fail("top_k", self.top_k, "an integer >= 0 (0 switches top-k off)")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            _fail("top_p", self.top_p, "a number in (0, 1] (1 switches top-p off)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, "True or False")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                _fail("stop_token_ids", self.stop_token_ids, "a sequence of integers >= 0")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                _fail("stop", self.stop, "a string or a sequence of non-empty strings")
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", self.seed, "None or an integer")


def _as_tuple(value: object, field: str) -> tuple[object, ...]:
    if isinstance(value, tuple):
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        _fail(field, value, "a sequence")
    return tuple(value)


def _fail(field: str, value: object, allowed: str) -> NoReturn:
    raise InvalidSamplingParamsError(
        f"SamplingParams.{field}={value!r} is invalid: expected {allowed}."
    )
