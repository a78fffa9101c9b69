"""ReasoningGate: a grammar matcher that starts after the reasoning-end token."""

from __future__ import annotations

import ctypes

import torch

from pagedinfer.adapters.sampling.reasoning_gate import ReasoningGate, gated
from pagedinfer.domain.reasoning import ReasoningEnd

END = 9
WORDS = 2  # 64 tokens


class Recorder:
    """A matcher that allows token 1 only and records what it consumes."""

    def __init__(self) -> None:
        self.consumed: list[int] = []

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        ctypes.memset(pointer, 0, size)
        ctypes.c_int32.from_address(pointer).value = 1 << 1

    def is_error(self) -> bool:
        return False

    def get_error(self) -> str:
        return ""

    def stop_reason(self) -> str:
        return "NotStopped"

    def consume_token(self, token: int) -> bool:
        self.consumed.append(token)
        return True

    def rollback(self, num_tokens: int) -> bool:
        del self.consumed[len(self.consumed) - num_tokens :]
        return True


def _mask(matcher: object) -> list[int]:
    row = torch.zeros(WORDS, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), WORDS * 4)  # type: ignore[attr-defined]
    bits = ((row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    return bits.nonzero().flatten().tolist()


def test_everything_passes_until_the_end_token_then_the_grammar_masks() -> None:
    inner = Recorder()
    gate = ReasoningGate(inner, ReasoningEnd([END, 10]))
    assert _mask(gate) == list(range(64)) and not gate.open
    for token in (5, 7, 63):
        assert gate.consume_token(token)
    assert inner.consumed == [] and _mask(gate) == list(range(64))
    assert gate.consume_token(END) and gate.open
    assert inner.consumed == [] and _mask(gate) == [1]  # the grammar, from its start
    assert gate.consume_token(1) and gate.consume_token(END)
    assert inner.consumed == [1, END]  # after the gate, even the end token is the grammar's


def test_a_rollback_across_the_end_token_closes_the_gate_again() -> None:
    inner = Recorder()
    gate = ReasoningGate(inner, ReasoningEnd([END]))
    for token in (5, END, 1, 1):
        gate.consume_token(token)
    assert gate.rollback(1) and inner.consumed == [1] and gate.open
    assert gate.rollback(2) and inner.consumed == [] and not gate.open
    assert _mask(gate) == list(range(64))
    assert gate.consume_token(END) and gate.open and inner.consumed == []


def test_no_reasoning_end_no_gate() -> None:
    inner = Recorder()
    assert gated(inner, None) is inner
    assert isinstance(gated(inner, ReasoningEnd([END])), ReasoningGate)
