"""When a sequence ends on its own: EOS, stop tokens, ``max_tokens``, ``max_model_len``.

The scheduler asks one question per sampled token (:meth:`StopRules.finish_reason`) and,
for a step's decode rows, one set intersection instead of a question per row
(:meth:`StopRules.scan`). Stop strings are the engine's (they need the detokenizer).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedinfer.domain.sequence import FinishReason, Sequence

__all__ = ["StopRules"]


class StopRules:
    """The stop rules of one scheduler: its EOS token ids and ``max_model_len``."""

    __slots__ = ("eos_token_ids", "max_model_len")

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Why ``seq`` ends with ``token_id`` (just appended), or ``None`` if it goes on."""
        params = seq.params
        num_completion = seq.num_completion_tokens
        # min_tokens completion tokens come before EOS or a stop token may end the request
        # (the sampler holds them back; a sampler that does not cannot end it early).
        if num_completion > params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
        if params.max_tokens is not None and num_completion >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def length_limit(self, seq: Sequence) -> int:
        """The token count at which ``seq`` finishes by length."""
        max_tokens = seq.params.max_tokens
        if max_tokens is None:
            return self.max_model_len
        return min(seq.num_prompt_tokens + max_tokens, self.max_model_len)

    def stop_ids(
        self, seqs: Iterable[Sequence], also: frozenset[int] = frozenset()
    ) -> frozenset[int]:
        """``also`` and every token that may stop one of ``seqs`` (EOS unless ignored, their
        stop token ids): a superset, tested per token by :meth:`finish_reason`."""
        stop_ids = set(also)
        with_eos = False
        for seq in seqs:
            stop_ids.update(seq.params.stop_token_ids)
            with_eos = with_eos or not seq.params.ignore_eos
        if with_eos:
            stop_ids.update(self.eos_token_ids)
        return frozenset(stop_ids)

    def scan(
        self, seqs: list[Sequence], tokens: list[int], stop_ids: frozenset[int]
    ) -> dict[Sequence, FinishReason]:
        """The decode rows ``seqs`` that just got ``tokens`` (one each, appended) and stop
        on them, with why. ``stop_ids`` covers the rows (:meth:`stop_ids`); the cost is one
        set intersection, plus a search per row whose token is in it."""
        finishing: dict[Sequence, FinishReason] = {}
        if not stop_ids or stop_ids.isdisjoint(tokens):
            return finishing
        for token in stop_ids.intersection(tokens):
            row = tokens.index(token)
            while True:
                seq = seqs[row]
                reason = self.finish_reason(seq, token)
                if reason is not None:
                    finishing[seq] = reason
                try:
                    row = tokens.index(token, row + 1)
                except ValueError:
                    break
        return finishing
