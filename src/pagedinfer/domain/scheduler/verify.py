"""Speculative decoding's verify rows, as the scheduler records them.

A verify row computes a sequence's last token and its drafts and is sampled at each of
those positions (:mod:`pagedinfer.domain.plan`). Recording it keeps the drafts its samples
accept, then one more sample (the correction, or the bonus token); :class:`VerifyStats`
counts what was proposed and accepted (vLLM's ``spec_decode`` counters). Finishing a
sequence on one of those tokens is the loop's (it owns the queues).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.speculative import accepted_length

__all__ = ["VerifyStats", "kept_drafts", "verified_rows"]


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
