"""Vocabulary-parallel token embedding and LM head.

Each rank holds ``vocab_size / world_size`` consecutive rows of the embedding matrix. The
embedding looks up the ids in its range, zeroes the others and sums over ranks; the LM head
computes its slice of the logits and gathers the full rows on rank 0 only (the only rank that
samples).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.layers.linear import (
    ShardId,
    divide,
    empty_parameter,
    set_weight_loader,
)

__all__ = ["ParallelLMHead", "VocabParallelEmbedding"]


class _VocabShard(nn.Module):
    """``weight [vocab_size / world_size, hidden_size]``: rows ``vocab_start:vocab_end``."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_rows = divide(vocab_size, parallel.world_size, "vocab_size")
        self.vocab_start = parallel.rank * self.num_rows
        self.vocab_end = self.vocab_start + self.num_rows
        self.weight = empty_parameter(self.num_rows, hidden_size, dtype=dtype, device=device)
        set_weight_loader(self.weight, self.weight_loader, self.checkpoint_shape)

    def checkpoint_shape(self, shard_id: ShardId) -> tuple[int, ...]:
        return (self.vocab_size, self.hidden_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        assert shard_id is None, "the embedding holds a single checkpoint tensor"
        shard = loaded_weight.narrow(0, self.vocab_start, self.num_rows)
        if shard.shape != param.shape:
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit an "
                f"embedding of {self.vocab_size} x {param.shape[1]}"
            )
        param.data.copy_(shard)


class VocabParallelEmbedding(_VocabShard):
    """Token id -> embedding row, each rank serving its slice of the vocabulary."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * in_range
        embedded = F.embedding(local_ids, self.weight)
        embedded.masked_fill_(~in_range.unsqueeze(-1), 0)
        return self.parallel.all_reduce(embedded)


class ParallelLMHead(_VocabShard):
    """Logits ``hidden @ W^T`` for the rows it is given; full rows on rank 0, None elsewhere.

    For tied embeddings the model shares the embedding's parameter with this module.
    ``batch_invariant``: fixed row tiles (``adapters/batch_invariant.py``).
    """

    batch_invariant = False

    def forward(self, hidden_rows: torch.Tensor) -> torch.Tensor | None:
        """``hidden_rows [n, hidden]`` -> ``[n, vocab_size]`` on the driver, else None."""
        if self.batch_invariant:
            from pagedinfer.adapters.batch_invariant import tiled_linear

            logits = tiled_linear(hidden_rows, self.weight)
        else:
            logits = F.linear(hidden_rows, self.weight)
        return self.parallel.gather_to_driver(logits, dim=-1)
