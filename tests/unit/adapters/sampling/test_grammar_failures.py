"""GrammarMatchers: a matcher that fails or reaches a dead end fails its own row only."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from pagedinfer.adapters.sampling.grammar import GrammarMatchers
from pagedinfer.domain import SamplingParams
from pagedinfer.domain.structured import StructuredOutputsParams
from pagedinfer.errors import InvalidStructuredOutputError

CPU = torch.device("cpu")
VOCAB = 64


class StubMatcher:
    """Allows ``allowed`` tokens; errors when it consumes ``poison``."""

    def __init__(self, allowed: list[int], poison: int | None = None) -> None:
        self.allowed, self.poison, self.error = allowed, poison, ""

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        ctypes.memset(pointer, 0, size)
        words = (ctypes.c_int32 * (size // 4)).from_address(pointer)
        for token in self.allowed:
            words[token // 32] |= 1 << (token % 32)

    def is_error(self) -> bool:
        return bool(self.error)

    def get_error(self) -> str:
        return self.error

    def stop_reason(self) -> str:
        return "NotStopped"

    def consume_token(self, token: int) -> bool:
        if token == self.poison:
            self.error = "lexer error: too many expressions constructed"
        return not self.error


@dataclass
class Compiled:
    matcher: StubMatcher

    def new_matcher(self) -> Any:
        return self.matcher


class StubCompiler:
    bitmask_words = VOCAB // 32

    def __init__(self) -> None:
        self.by_regex: dict[str, StubMatcher] = {}

    def compile(self, params: StructuredOutputsParams) -> Compiled:
        assert params.regex is not None
        if params.regex == "refused":
            raise InvalidStructuredOutputError("StructuredOutputsParams.regex is refused: x")
        return Compiled(self.by_regex[params.regex])


@dataclass(frozen=True)
class Request:
    seq_id: int
    slot: int
    params: SamplingParams


def install(matchers: GrammarMatchers, slot: int, regex: str) -> None:
    constraint = StructuredOutputsParams(regex=regex)
    matchers.install(Request(slot, slot, SamplingParams(structured_outputs=constraint)))  # type: ignore[arg-type]


def test_a_dead_end_an_error_and_a_refusal_fail_their_rows_only() -> None:
    compiler = StubCompiler()
    compiler.by_regex = {
        "ok": StubMatcher([3, 40]),
        "dead": StubMatcher([]),
        "poisoned": StubMatcher([7], poison=7),
    }
    matchers = GrammarMatchers(compiler, CPU)  # type: ignore[arg-type]
    for slot, regex in enumerate(["ok", "dead", "poisoned", "refused"]):
        install(matchers, slot, regex)
    step = matchers.fill([0, 1, 2, 3, 9])  # slot 9: an unconstrained row
    assert step is not None and step.row_indices == (0, 1, 2, 3)
    assert set(step.failed) == {1, 3}
    assert "dead end" in step.failed[1] and "refused" in step.failed[3]
    matchers.accept(step, [40, 0, 7, 0, 5])
    assert set(step.failed) == {1, 2, 3}
    assert "too many expressions" in step.failed[2]
    assert not compiler.by_regex["ok"].is_error()
