"""What the model runner and the weight loader expect of a causal language model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from pagedinfer.adapters.attention.base import AttentionBackend, AttentionMetadata
from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.layers.attention import PagedAttention
from pagedinfer.adapters.layers.linear import ShardId
from pagedinfer.adapters.models.config import ModelConfig

__all__ = ["CausalLM"]


class CausalLM(nn.Module):
    """A decoder-only model over a paged KV cache.

    ``packed_modules_mapping`` maps a checkpoint module name to ``(packed module, shard id)``
    when several checkpoint tensors live in one parameter (``q_proj -> (qkv_proj, "q")``).
    """

    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, ShardId]]] = {}

    def __init__(
        self, config: ModelConfig, *, parallel: ParallelContext, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` -> final hidden states ``[T, hidden]``."""
        raise NotImplementedError

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor | None:
        """``[n, hidden]`` -> logits ``[n, vocab]`` on the driver rank, None on the others."""
        raise NotImplementedError

    def attention_layers(self) -> list[PagedAttention]:
        """The attention layers in layer order (layer ``i`` uses KV-cache slice ``i``)."""
        return [module for module in self.modules() if isinstance(module, PagedAttention)]

    def is_ignored_weight(self, name: str) -> bool:
        """Checkpoint tensors that are legitimately unused (e.g. a tied ``lm_head``)."""
        return False
