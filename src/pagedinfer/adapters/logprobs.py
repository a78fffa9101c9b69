"""Log-probabilities for outputs: top-k per row plus a chosen token, with its rank.

As in vLLM v1 (its default ``raw_logprobs`` mode), the numbers are those of the model's own
distribution: ``log_softmax`` of the logits *before* bias, masks, penalties, temperature and
filters. So the sampler takes them from the logits before it processes them in place, and
gathers the sampled token's entry once the token is known.

Results stay on the device as one :class:`TokenLogprobs`; the executor moves them to the host
in one transfer (:meth:`TokenLogprobs.tolist`). Prompt logprobs use the same gather with the
next prompt token as the chosen one, a bounded number of rows at a time
(:func:`prompt_logprobs`), since ``[prompt tokens, vocab]`` float32 would not fit for long
prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["TokenLogprobs", "compute_logprobs", "gather_logprobs", "prompt_logprobs"]

# Rows of prompt logits materialised at once by prompt_logprobs.
PROMPT_LOGPROBS_ROWS = 256


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
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
        """(ids, logprobs, ranks) as Python lists, in one device-to-host transfer each."""
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()

    @staticmethod
    def cat(parts: list[TokenLogprobs]) -> TokenLogprobs:
        return TokenLogprobs(
            token_ids=torch.cat([part.token_ids for part in parts]),
            logprobs=torch.cat([part.logprobs for part in parts]),
            ranks=torch.cat([part.ranks for part in parts]),
        )


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` in float32 (a new tensor: the logits may be processed in place later)."""
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> TokenLogprobs:
    """The chosen ``token_ids [n]`` and the ``num_top`` likeliest tokens of ``logprobs [n, V]``."""
    chosen = token_ids.to(torch.int64).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1)
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
        chosen = torch.cat([chosen, top_ids], dim=1)
        chosen_logprobs = torch.cat([chosen_logprobs, top_logprobs], dim=1)
    return TokenLogprobs(token_ids=chosen, logprobs=chosen_logprobs, ranks=ranks)


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    next_token_ids: torch.Tensor,
    num_top: int,
    *,
    max_rows: int = PROMPT_LOGPROBS_ROWS,
) -> TokenLogprobs:
    """Logprobs of ``next_token_ids [T]`` given ``hidden [T, H]``, ``max_rows`` rows at a time.

    ``compute_logits`` maps hidden states to ``[rows, vocab]`` logits (the model's LM head).
    Row ``t`` is the distribution after the first ``t + 1`` tokens of the chunk, so the
    chosen token is the prompt token that follows.
    """
    parts = []
    for start in range(0, hidden.shape[0], max_rows):
        logits = compute_logits(hidden[start : start + max_rows])
        targets = next_token_ids[start : start + max_rows]
        parts.append(gather_logprobs(compute_logprobs(logits), targets, num_top))
    return parts[0] if len(parts) == 1 else TokenLogprobs.cat(parts)
