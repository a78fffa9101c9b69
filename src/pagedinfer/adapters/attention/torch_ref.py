"""The reference backend: gather pages, call ``scaled_dot_product_attention``.

Runs on CPU and CUDA and is the oracle the Triton and flash backends are tested against.
It is also the production backend on CPU, so the common cases avoid needless work: a
prefill with no cached prefix attends over the step's own K/V without touching the cache,
and decode is one batched SDPA call over the gathered pages.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from pagedinfer.adapters.attention.base import AttentionMetadata

__all__ = ["TorchAttentionBackend", "gather_context", "store_kv_torch"]


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    has_padding_slots: bool = True,
) -> None:
    """Write each token's K/V to its slot; slots ``< 0`` are skipped."""
    num_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    flat_k = k_cache.view(-1, num_heads, head_dim)
    flat_v = v_cache.view(-1, num_heads, head_dim)
    if has_padding_slots:
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence's pages: ``[length, kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    pages = cache.index_select(0, block_table[:num_blocks].long())
    return pages.flatten(0, 1)[:length]


def _sdpa(
    query: torch.Tensor,  # [heads, q, dim]
    key: torch.Tensor,  # [kv_heads, k, dim]
    value: torch.Tensor,
    scale: float,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=query.shape[-3] != key.shape[-3],
    )


class TorchAttentionBackend:
    """Paged attention with plain torch ops; any block size."""

    name: ClassVar[str] = "torch"
    supports_cuda_graphs: ClassVar[bool] = False

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        store_kv_torch(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv_torch(
            key,
            value,
            k_cache,
            v_cache,
            meta.slot_mapping,
            has_padding_slots=meta.has_padding_slots,
        )
        if meta.is_prefill:
            return self._prefill(query, key, value, k_cache, v_cache, meta, scale)
        return self._decode(query, k_cache, v_cache, meta, scale)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        query_lens = _host(meta.query_lens_host, meta.cu_seqlens_q.diff())
        context_lens = _host(meta.context_lens_host, meta.context_lens)
        output = torch.empty_like(query)
        start = 0
        for index, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens, strict=True)):
            end = start + q_len
            q = query[start:end].transpose(0, 1)
            if ctx_len == q_len:  # nothing cached: this step's own K/V are the whole context
                k = key[start:end].transpose(0, 1)
                v = value[start:end].transpose(0, 1)
                out = _sdpa(q, k, v, scale, is_causal=True)
            else:
                table = meta.block_tables[index]
                k = gather_context(k_cache, table, ctx_len).transpose(0, 1)
                v = gather_context(v_cache, table, ctx_len).transpose(0, 1)
                # Query i sits at position ctx_len - q_len + i and sees keys up to there.
                rows = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
                mask = torch.arange(ctx_len, device=query.device)[None, :] <= rows[:, None]
                out = _sdpa(q, k.to(q.dtype), v.to(q.dtype), scale, attn_mask=mask)
            output[start:end] = out.transpose(0, 1)
            start = end
        return output

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_seqs = query.shape[0]
        longest = _host_max(meta.context_lens_host, meta.context_lens)
        # Gather each sequence's first `longest` slots (not whole pages): one index_select per
        # cache over flat slot ids, [B, longest] -> [B, longest, kv_heads, head_dim].
        positions = torch.arange(longest, device=query.device)
        tables = meta.block_tables.long()
        slots = tables[:, positions // self.block_size] * self.block_size
        slots += positions % self.block_size
        flat_slots = slots.view(-1)
        num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
        shape = (num_seqs, longest, num_kv_heads, head_dim)
        k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, flat_slots).view(shape)
        v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, flat_slots).view(shape)
        mask = positions[None, :] < meta.context_lens[:, None].to(positions.dtype)
        out = _sdpa(
            query.view(num_seqs, -1, 1, head_dim),
            k.transpose(1, 2).to(query.dtype),
            v.transpose(1, 2).to(query.dtype),
            scale,
            attn_mask=mask[:, None, None, :],
        )
        return out.view(num_seqs, -1, head_dim)


def _host(values: list[int] | None, tensor: torch.Tensor) -> list[int]:
    return values if values is not None else [int(x) for x in tensor.tolist()]


def _host_max(values: list[int] | None, tensor: torch.Tensor) -> int:
    return max(values) if values else int(tensor.max().item())
