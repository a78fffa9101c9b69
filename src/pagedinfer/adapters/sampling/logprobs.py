"""Log-probabilities for outputs: top-k per row plus a chosen token, with its rank.

By default (vLLM v1's ``raw_logprobs`` mode), the numbers are those of the model's own
distribution: ``log_softmax`` of the logits *before* bias, masks, penalties, temperature and
filters. So the runner takes them from the logits before the sampler processes them in place,
and gathers the sampled token's entry once the token is known. The engine's
``logprobs_mode`` picks other values (:mod:`pagedinfer.adapters.sampling.logprobs_mode`).

:class:`LogprobsRequests` (rank 0) knows which live requests asked for logprobs, by slot and by
sequence, from the sampling table's install / release deltas; a step in which none did costs
one integer test. Results stay on the device as :class:`LogprobsTensors` until one transfer
turns them into the domain's :class:`~pagedinfer.domain.step_output.TokenLogprobs`. Prompt
logprobs use the same gather with the next prompt token as the chosen one, a bounded number of
rows at a time (:func:`prompt_logprobs`): ``[prompt tokens, vocab]`` float32 would not fit for
long prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedinfer.adapters.sampling.table import InstalledRequest
from pagedinfer.domain.step_output import PromptLogprobsChunk, TokenLogprobs

__all__ = [
    "PROMPT_LOGPROBS_ROWS",
    "LogprobsRequests",
    "LogprobsTensors",
    "compute_logprobs",
    "gather_logprobs",
    "prompt_logprobs",
]

# Rows of prompt logits materialised at once by prompt_logprobs.
PROMPT_LOGPROBS_ROWS = 256


@dataclass(frozen=True, slots=True)
class LogprobsTensors:
    """Per row: the chosen token's id, logprob and rank, then the top ``k`` ids and logprobs.

    ``token_ids[:, 0]`` / ``logprobs[:, 0]`` are the chosen token, columns ``1..k`` the top
    ``k`` in descending order (their ranks are 1..k). ``ranks`` is the chosen token's rank as
    vLLM counts it: the number of tokens whose logprob is >= its own (1 for the most likely
    token; tied tokens share the larger rank).
    """

    token_ids: torch.Tensor  # [n, 1 + k] int64
    logprobs: torch.Tensor  # [n, 1 + k] float32
    ranks: torch.Tensor  # [n] int64

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0])

    def tolist(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """(ids, logprobs, ranks) as Python lists."""
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()

    def entries(self, num_top: Sequence[int]) -> list[TokenLogprobs]:
        """One :class:`TokenLogprobs` per row, row ``i`` cut to ``num_top[i]`` top tokens."""
        ids, logprobs, ranks = self.tolist()
        return [
            TokenLogprobs(ids[i][: 1 + k], logprobs[i][: 1 + k], ranks[i])
            for i, k in enumerate(num_top)
        ]

    @staticmethod
    def cat(parts: list[LogprobsTensors]) -> LogprobsTensors:
        return LogprobsTensors(
            token_ids=torch.cat([part.token_ids for part in parts]),
            logprobs=torch.cat([part.logprobs for part in parts]),
            ranks=torch.cat([part.ranks for part in parts]),
        )


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` in float32 (a new tensor: the logits may be processed in place later)."""
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> LogprobsTensors:
    """The chosen ``token_ids [n]`` and the ``num_top`` likeliest tokens of ``logprobs [n, V]``."""
    chosen = token_ids.to(torch.int64).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1)
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
        chosen = torch.cat([chosen, top_ids], dim=1)
        chosen_logprobs = torch.cat([chosen_logprobs, top_logprobs], dim=1)
    return LogprobsTensors(token_ids=chosen, logprobs=chosen_logprobs, ranks=ranks)


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    hidden: torch.Tensor,
    next_token_ids: torch.Tensor | None,
    num_top: int,
    *,
    max_rows: int = PROMPT_LOGPROBS_ROWS,
) -> LogprobsTensors | None:
    """Logprobs of ``next_token_ids [T]`` given ``hidden [T, H]``, ``max_rows`` rows at a time.

    ``compute_logits`` maps hidden states to ``[rows, vocab]`` logits (the model's LM head;
    ``None`` on tensor-parallel ranks that do not sample, which still take part in every
    call, so all ranks must run this with the same ``hidden`` rows). Row ``t`` is the
    distribution after its token, so the chosen token is the prompt token that follows.
    Returns ``None`` where ``compute_logits`` does.
    """
    parts = []
    for start in range(0, hidden.shape[0], max_rows):
        logits = compute_logits(hidden[start : start + max_rows])
        if logits is None or next_token_ids is None:
            continue
        targets = next_token_ids[start : start + max_rows]
        parts.append(gather_logprobs(compute_logprobs(logits), targets, num_top))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else LogprobsTensors.cat(parts)


@dataclass(frozen=True, slots=True)
class _Asked:
    seq_id: int
    logprobs: int | None
    prompt_logprobs: int | None


class LogprobsRequests:
    """Which live requests asked for logprobs (by sampling slot) or prompt logprobs (by
    sequence id); fed by the sampling table's :meth:`install` / :meth:`release` callbacks."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._by_slot: dict[int, _Asked] = {}
        self._prompt_by_seq: dict[int, int] = {}  # seq id -> prompt_logprobs

    def install(self, request: InstalledRequest) -> None:
        params = request.params
        if params.logprobs is None and params.prompt_logprobs is None:
            return
        self.release(request.slot)
        self._by_slot[request.slot] = _Asked(
            request.seq_id, params.logprobs, params.prompt_logprobs
        )
        if params.prompt_logprobs is not None:
            self._prompt_by_seq[request.seq_id] = params.prompt_logprobs

    def release(self, slot: int) -> None:
        asked = self._by_slot.pop(slot, None)
        if asked is not None:
            self._prompt_by_seq.pop(asked.seq_id, None)

    def sample_rows(self, sample_slots: Sequence[int]) -> tuple[list[int], list[int]] | None:
        """The samples that want logprobs (their indices, and how many top tokens each), or
        ``None`` when none does."""
        by_slot = self._by_slot
        if not by_slot:
            return None
        rows: list[int] = []
        num_top: list[int] = []
        for row, slot in enumerate(sample_slots):
            asked = by_slot.get(slot)
            if asked is not None and asked.logprobs is not None:
                rows.append(row)
                num_top.append(min(asked.logprobs, self.vocab_size))
        return (rows, num_top) if rows else None

    def prompt_num_top(self, seq_id: int) -> int:
        """How many top tokens request ``seq_id`` wants per prompt token (0 if unknown)."""
        return min(self._prompt_by_seq.get(seq_id, 0), self.vocab_size)

    def prompt_chunks(
        self,
        result: LogprobsTensors,
        rows: Sequence[tuple[int, int, int]],
        positions: Sequence[int],
    ) -> list[PromptLogprobsChunk]:
        """Split one step's prompt logprobs (rows laid out as ``plan.prompt_logprob_rows``)
        into one chunk per sequence, each entry cut to that request's top-k."""
        num_top = [self.prompt_num_top(seq_id) for seq_id, _, count in rows for _ in range(count)]
        entries = result.entries(num_top)
        chunks = []
        offset = 0
        for seq_id, first_row, count in rows:
            first_position = positions[first_row] + 1  # the token the first row predicts
            chunks.append(
                PromptLogprobsChunk(seq_id, first_position, entries[offset : offset + count])
            )
            offset += count
        return chunks
