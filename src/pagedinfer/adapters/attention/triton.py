"""The ``triton`` backend: the project's own paged-attention kernels.

* store: :func:`~pagedinfer.adapters.kernels.store_kv.store_kv_cache`
* prefill (also prefix-cache hits and chunked prefill): one varlen kernel over the paged
  context, :func:`~pagedinfer.adapters.kernels.prefill_attention.paged_prefill_attention`
* decode: GQA-grouped split-KV kernel plus a reduction,
  :func:`~pagedinfer.adapters.kernels.decode_attention.paged_decode_attention`

A mixed step (decode rows first, then prefill chunks) launches both in one forward: the decode
kernel over its decode rows (GQA-grouped and split-KV: each K/V page is read once per KV head,
and long contexts spread over many programs) and the prefill kernel over its chunks, each
writing its rows of one output (``split_mixed_steps``, the default). With
``split_mixed_steps=False`` the prefill kernel serves every row, a decode row being a
one-query tile of ``BLOCK_M`` rows that reads its pages once per query head.

Decode reads no host values: the batch size and the context capacity come from tensor
shapes (the captured block-table width covers ``max_model_len``), so decode steps can be
captured in CUDA graphs. The split-KV partials live in a workspace owned by the backend; call
:meth:`TritonAttentionBackend.reserve` before capturing graphs so the workspace is allocated
once, outside any capture, at its largest size.

FP8 KV cache (a float8 cache and the layer's scale row ``kv_scales``): every kernel works on
the cache's bytes, the store quantizing and the attention kernels dequantizing on the fly
(:mod:`pagedinfer.adapters.kernels.fp8`); the scales are read on the device, so captured
graphs stay valid when they change.
"""

from __future__ import annotations

import functools
import os
from typing import ClassVar

import torch

from pagedinfer.adapters.attention.base import AttentionMetadata, PagedAttentionBackend
from pagedinfer.adapters.kernels.decode_attention import (
    MAX_SPLITS,
    SplitPartials,
    choose_num_splits,
    paged_decode_attention,
    split_workspace_numel,
)
from pagedinfer.adapters.kernels.prefill_attention import paged_prefill_attention
from pagedinfer.adapters.kernels.store_kv import store_kv_cache
from pagedinfer.errors import ConfigurationError

__all__ = ["TritonAttentionBackend"]

# tl.dot works on tiles of at least 16 rows; pages are read in whole multiples of that.
BLOCK_SIZE_MULTIPLE = 16


class TritonAttentionBackend(PagedAttentionBackend):
    """Paged attention with the project's Triton kernels; block sizes that are multiples of 16.

    ``num_splits`` fixes the number of split-KV partitions for decode (``1`` turns splitting
    off); ``None`` picks it per batch from the batch size, kv heads, SM count and block-table
    width, and for a sliding-window layer from its window (see
    :func:`~pagedinfer.adapters.kernels.decode_attention.choose_num_splits`).
    ``split_mixed_steps``: see the module docstring.
    """

    name: ClassVar[str] = "triton"
    supports_cuda_graphs: ClassVar[bool] = True

    def __init__(
        self, block_size: int, *, num_splits: int | None = None, split_mixed_steps: bool = True
    ) -> None:
        if block_size <= 0 or block_size % BLOCK_SIZE_MULTIPLE != 0:
            raise ConfigurationError(
                f"kv_block_size={block_size} does not suit the triton attention backend: it "
                f"needs a positive multiple of {BLOCK_SIZE_MULTIPLE} (e.g. 16, 32, 256). Choose "
                "such a block size or attention_backend='torch'."
            )
        if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
            raise ConfigurationError(
                f"num_splits={num_splits} is out of range: it must be between 1 and "
                f"{MAX_SPLITS}, or None to choose per batch."
            )
        super().__init__(block_size, split_mixed_steps=split_mixed_steps)
        self.num_splits = num_splits
        self._workspace: torch.Tensor | None = None
        # Every workspace ever handed out, replaced ones included: a CUDA graph captured over
        # one keeps writing to its address on every replay, so none may be freed (and its
        # memory reused) while the backend lives. Growth is rare: reserve() sizes the
        # workspace for every graph batch before the first capture.
        self._retired: list[torch.Tensor] = []

    def reserve(
        self,
        max_num_seqs: int,
        num_heads: int,
        head_dim: int,
        *,
        num_kv_heads: int = 1,
        device: torch.device | str = "cuda",
    ) -> None:
        """Allocate the split-KV workspace for every decode batch of up to ``max_num_seqs``.

        Call once before capturing CUDA graphs (``num_heads`` / ``num_kv_heads`` per rank).
        The size covers the most partitions any batch size can get, whatever the context
        length; ``num_kv_heads=1`` is the safe over-estimate. Without it the workspace grows
        on demand, which is fine in eager mode.
        """
        device = _concrete(torch.device(device))
        needed = max(
            split_workspace_numel(
                batch, num_heads, self._splits(batch, num_kv_heads, None, device), head_dim
            )
            for batch in range(1, max_num_seqs + 1)
        )
        self._workspace_of(needed, device)

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        kv_scales: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention over the cache, which already holds this step's K/V (stored by
        :meth:`forward`, or by the fused q/k-norm + RoPE + store kernel of the layer)."""
        assert k_cache.shape[1] == self.block_size, (k_cache.shape, self.block_size)
        return self._attend(
            query, None, None, k_cache, v_cache, meta, scale, kv_scales,
            window=window, sinks=sinks, softcap=softcap,
        )  # fmt: skip

    # ------------------------------------------------------------------ the kernels
    def _store(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        has_padding_slots: bool,
        kv_scales: torch.Tensor | None,
    ) -> None:
        assert k_cache.shape[1] == self.block_size, (k_cache.shape, self.block_size)
        store_kv_cache(key, value, k_cache, v_cache, slot_mapping, kv_scales=kv_scales)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None,
        out: torch.Tensor | None,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            context_lens=meta.context_lens,
            block_tables=meta.block_tables,
            max_seqlen_q=meta.max_seqlen_q,
            scale=scale,
            out=out,
            kv_scales=kv_scales,
            window=window,
            sinks=sinks,
            softcap=softcap,
        )

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None,
        out: torch.Tensor | None,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        # Shapes and static settings only: this runs inside CUDA-graph captures.
        num_seqs, num_heads, head_dim = query.shape
        capacity = int(meta.block_tables.shape[1]) * self.block_size
        num_splits = self._splits(
            num_seqs, int(k_cache.shape[2]), capacity, query.device, window, head_dim
        )
        partials = None
        if num_splits > 1:
            needed = split_workspace_numel(num_seqs, num_heads, num_splits, head_dim)
            buffer = self._workspace_of(needed, query.device)
            partials = SplitPartials.from_buffer(buffer, num_seqs, num_heads, num_splits, head_dim)
        return paged_decode_attention(
            query,
            k_cache,
            v_cache,
            context_lens=meta.context_lens,
            block_tables=meta.block_tables,
            scale=scale,
            num_splits=num_splits,
            partials=partials,
            out=out,
            kv_scales=kv_scales,
            window=window,
            sinks=sinks,
            softcap=softcap,
        )

    def _splits(
        self,
        num_seqs: int,
        num_kv_heads: int,
        capacity: int | None,
        device: torch.device,
        window: int | None = None,
        head_dim: int = 128,
    ) -> int:
        """Decode partitions: the fixed ``num_splits``, else chosen from static facts. A
        sliding-window layer gets no more than its window's keys call for (never more than a
        full layer of the same batch, so :meth:`reserve`'s workspace covers it)."""
        if self.num_splits is not None:
            return self.num_splits
        unbounded = 1 << 62  # reserve(): the longest context any table could describe
        return choose_num_splits(
            num_seqs,
            num_kv_heads,
            unbounded if capacity is None else capacity,
            _num_sms(device),
            window=window,
            head_dim=head_dim,
        )

    def _workspace_of(self, numel: int, device: torch.device) -> torch.Tensor:
        """A float32 buffer of at least ``numel`` elements on ``device``; grows, never shrinks."""
        current = self._workspace
        if current is not None and current.numel() >= numel and current.device == device:
            return current
        if current is not None:
            self._retired.append(current)
        size = max(numel, current.numel() if current is not None else 0)
        self._workspace = torch.empty(size, dtype=torch.float32, device=device)
        return self._workspace


def _concrete(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, so it compares equal to a tensor's device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; CPU cores under the interpreter."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).multi_processor_count)
    return os.cpu_count() or 1
