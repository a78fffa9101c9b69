"""``Pooler``: a pooling model's step output, the pooled hidden states of each prefill chunk.

A pooling model (``runner="pooling"``) computes prompts only: the hidden states after the
final norm are pooled instead of being turned into logits and sampled. What a chunk
contributes depends on the pooling type:

* ``LAST``: the prompt's last row, in the chunk that completes the prompt (its sampled row);
* ``CLS``: the row at position 0, in the chunk that starts the prompt;
* ``MEAN``: the sum of every row of the chunk and how many there are (the engine adds the
  chunks up and divides once the prompt is complete).

Each sample of the step still gets a placeholder token (0), which the scheduler records to
finish the request (a pooling request asks for one token); nothing is sampled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.step_output import PooledChunk, StepOutput

__all__ = ["POOLING_TYPES", "Pooler"]

POOLING_TYPES: tuple[str, ...] = ("LAST", "MEAN", "CLS")


class Pooler:
    """Pools one step's hidden states (``[num_tokens, hidden]``) per sequence."""

    def __init__(self, pooling_type: str) -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type {pooling_type!r}: expected one of {POOLING_TYPES}")
        self.pooling_type = pooling_type

    def pool(self, plan: BatchPlan, hidden: torch.Tensor) -> Callable[[], StepOutput]:
        """Launch the pooling of ``plan``'s rows and return the read of the step's output."""
        seq_ids, first_rows, counts, rows = self._select(plan, hidden)
        num_samples = plan.num_samples
        summed = self.pooling_type == "MEAN"
        positions = plan.positions

        def read() -> StepOutput:
            values = rows.to(torch.float32).cpu().tolist()
            chunks = [
                PooledChunk(seq_id, positions[first], count, row, summed)
                for seq_id, first, count, row in zip(
                    seq_ids, first_rows, counts, values, strict=True
                )
            ]
            return StepOutput([0] * num_samples, pooled=chunks)

        return read

    def _select(
        self, plan: BatchPlan, hidden: torch.Tensor
    ) -> tuple[list[int], list[int], list[int], torch.Tensor]:
        """The sequences this step pools, their chunk's first row, its row count and the
        pooled rows on the device."""
        cu = plan.cu_seqlens_q
        num_seqs = len(plan.seq_ids)
        if self.pooling_type == "MEAN":
            seq_ids = list(plan.seq_ids)
            firsts = [cu[i] for i in range(num_seqs)]
            counts = [cu[i + 1] - cu[i] for i in range(num_seqs)]
            lengths = torch.tensor(counts, device=hidden.device)
            owner = torch.repeat_interleave(torch.arange(num_seqs, device=hidden.device), lengths)
            sums = torch.zeros(num_seqs, hidden.shape[1], dtype=torch.float32, device=hidden.device)
            sums.index_add_(0, owner, hidden[: cu[num_seqs]].to(torch.float32))
            return seq_ids, firsts, counts, sums
        if self.pooling_type == "CLS":
            picked = [i for i in range(num_seqs) if plan.positions[cu[i]] == 0]
            seq_ids = [plan.seq_ids[i] for i in picked]
            firsts = [cu[i] for i in picked]
        else:  # LAST: the rows that complete a prompt are the sampled rows
            firsts = list(plan.sample_indices)
            seq_ids = plan.sampled_seq_ids
        index = torch.tensor(firsts, dtype=torch.int64, device=hidden.device)
        return seq_ids, firsts, [1] * len(firsts), hidden.index_select(0, index)
