"""Speculative decoding's verify rows, as the scheduler records them.

A verify row computes a sequence's last token and its drafts and is sampled at each of
those positions (:mod:`pagedinfer.domain.plan`). Recording it keeps the drafts its samples
accept, then one more sample (the correction, or the bonus token); :class:`VerifyStats`
counts what was proposed and accepted (vLLM's ``spec_decode`` counters). Finishing a
sequence on one of those tokens is the loop's (it owns the queues).

Whether a scheduler speculates is decided once, by its :class:`DecodingPolicy`: without
speculation a sequence whose prompt is computed decodes one token per step in the decode
rows (:class:`RowDecoding`); with it, every step gives it a chunk of its last token and its
drafts, a verify row (:class:`VerifyDecoding`).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Protocol

from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.sequence import Sequence
from pagedinfer.domain.speculative import accepted_length

__all__ = [
    "DecodingPolicy",
    "RowDecoding",
    "VerifyDecoding",
    "VerifyStats",
    "decoding_policy",
    "kept_drafts",
    "verified_rows",
]


def verified_rows(plan: BatchPlan, tokens: list[int]) -> dict[int, tuple[list[int], list[int]]]:
    """Each verify row's sequence id -> (its drafts in ``plan``, its samples in ``tokens``)."""
    return {
        plan.seq_ids[row]: (drafts, tokens[first : first + len(drafts) + 1])
        for row, first, drafts in plan.verify_drafts()
    }


def kept_drafts(draft_token_ids: SequenceABC[int], limit: int, room: int) -> list[int]:
    """The leading drafts a sequence keeps: at most ``limit`` (``num_speculative_tokens``)
    and ``room`` (the tokens left before its length limit, the bonus token aside)."""
    return list(draft_token_ids[: max(0, min(len(draft_token_ids), limit, room))])


class VerifyStats:
    """Verify rows recorded, drafts verified and accepted, accepted by position in the row."""

    __slots__ = ("accepted_per_position", "num_accepted_tokens", "num_draft_tokens", "num_rows")

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_rows = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def accept(self, drafts: list[int], samples: list[int]) -> list[int]:
        """Count one verify row; return the tokens it adds: the accepted drafts (equal to
        their samples) and the sample after them."""
        accepted = accepted_length(samples, drafts)
        self.num_rows += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        per_position = self.accepted_per_position
        for index in range(accepted):
            per_position[index] += 1
        return samples[: accepted + 1]


class DecodingPolicy(Protocol):
    """How a sequence goes on once its prompt is computed: the loop's questions whose answer
    depends on speculative decoding being on."""

    def ready_to_decode(self, seq: Sequence) -> bool:
        """Whether running ``seq``, prefilling, moves to the decode rows now."""
        ...

    def drafts(self, draft_token_ids: SequenceABC[int], room: int) -> list[int]:
        """The drafts a running sequence keeps (``room``: tokens left before its length
        limit, the bonus token aside)."""
        ...

    def check_plan_ahead(self) -> None:
        """Raise ``ValueError`` if a plan cannot be made before the tokens in flight."""
        ...


class RowDecoding:
    """No speculation: one prompt token left (its logits give the first completion token),
    a sequence decodes one token per step in a row; drafts are ignored."""

    __slots__ = ()

    def ready_to_decode(self, seq: Sequence) -> bool:
        return seq.num_uncomputed_tokens == 1

    def drafts(self, draft_token_ids: SequenceABC[int], room: int) -> list[int]:
        return []

    def check_plan_ahead(self) -> None:
        return None


class VerifyDecoding:
    """Speculative decoding with ``num_speculative_tokens`` drafts: a sequence never joins
    the decode rows, every step computes its last token and drafts in a chunk."""

    __slots__ = ("num_speculative_tokens",)

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    def ready_to_decode(self, seq: Sequence) -> bool:
        return False

    def drafts(self, draft_token_ids: SequenceABC[int], room: int) -> list[int]:
        return kept_drafts(draft_token_ids, self.num_speculative_tokens, room)

    def check_plan_ahead(self) -> None:
        raise ValueError(
            "schedule_ahead() plans before the plan in flight's tokens are known; with "
            "speculative decoding the next drafts follow them: use schedule()."
        )


def decoding_policy(num_speculative_tokens: int) -> DecodingPolicy:
    """The policy of a scheduler with ``num_speculative_tokens`` drafts per step (0: off)."""
    if num_speculative_tokens > 0:
        return VerifyDecoding(num_speculative_tokens)
    return RowDecoding()
