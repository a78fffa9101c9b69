"""The attention layer: this layer's slice of the paged KV cache plus a backend call."""

from __future__ import annotations

import torch
from torch import nn

from pagedinfer.adapters.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["PagedAttention"]


class PagedAttention(nn.Module):
    """Stores the step's K/V in this layer's cache pages and attends over them.

    ``k_cache`` / ``v_cache`` are views ``[num_blocks, block_size, num_kv_heads, head_dim]`` into
    the runner's single KV-cache tensor, bound with :meth:`bind_cache` once the cache exists.
    They are plain attributes, not buffers: they are not weights and must not be moved,
    copied or saved with the model.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scale: float,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        assert k_cache.shape == v_cache.shape and k_cache.dim() == 4
        assert k_cache.shape[-2:] == (self.num_kv_heads, self.head_dim), k_cache.shape
        self.k_cache = k_cache
        self.v_cache = v_cache

    def unbind_cache(self) -> None:
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``query [T, heads, dim]``, ``key`` / ``value [T, kv_heads, dim]`` -> ``[T, heads, dim]``

        ``meta`` is this step's metadata, passed down explicitly from the runner.
        """
        return self.backend.forward(query, key, value, self.k_cache, self.v_cache, meta, self.scale)
