"""The ``flash`` backend: flash-attn's varlen and paged-KV kernels (CUDA only).

* store: the project's Triton store kernel on CUDA (the torch fallback elsewhere);
* prefill without a cached prefix: ``flash_attn_varlen_func`` on the step's own K/V;
* prefill with a cached prefix (prefix-cache hits, chunked prefill): the same function reading
  the paged cache through ``block_table``;
* decode: ``flash_attn_with_kvcache`` with ``cache_seqlens`` and ``block_table``.

A mixed step (decode rows first, then prefill chunks) runs both calls in one forward: the
decode call over its decode rows (flash-attn packs a KV head's query heads into one tile when
each sequence has one query, and splits long contexts) and the varlen call over its chunks
(``split_mixed_steps``, the default); with ``split_mixed_steps=False`` one varlen call over the
paged cache serves every row (what vLLM's FlashAttention backend does).

flash-attn's paged kernels need pages of a multiple of 256 tokens; other block sizes are
refused at construction, and so is an FP8 KV cache (flash-attn 2 reads K/V in the query's
dtype; ``attention_backend="auto"`` picks ``triton`` for ``kv_cache_dtype="fp8"``). A sliding
window is flash-attn's ``window_size``; layers with attention sinks are refused when the
model is built (flash-attn 2 has none). Capped attention logits (a layer's ``softcap``) are
flash-attn's ``softcap`` argument (flash-attn >= 2.6); with an older flash-attn such layers
are refused when the model is built.
``flash_attn`` is imported when the backend is built, so the rest of the package works
without it (install it with the ``flash`` extra).
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import ClassVar

import torch

from pagedinfer.adapters.attention import FLASH_BLOCK_SIZE_MULTIPLE
from pagedinfer.adapters.attention.base import AttentionMetadata, PagedAttentionBackend
from pagedinfer.adapters.attention.torch_ref import store_kv_torch
from pagedinfer.errors import ConfigurationError, install_hint

__all__ = ["FlashAttentionBackend"]


def _import_flash_attn() -> ModuleType:
    try:
        return importlib.import_module("flash_attn")
    except Exception as error:  # ImportError, or a broken build failing to load its library
        raise ConfigurationError(
            f"attention_backend='flash' needs the flash-attn package, which failed to import "
            f"({type(error).__name__}: {error}). Install it with {install_hint('flash')} "
            "or use attention_backend='triton'."
        ) from error


class FlashAttentionBackend(PagedAttentionBackend):
    """Paged attention with flash-attn; block sizes that are multiples of 256."""

    name: ClassVar[str] = "flash"
    supports_cuda_graphs: ClassVar[bool] = True
    supports_sinks: ClassVar[bool] = False

    def __init__(
        self, block_size: int, *, split_mixed_steps: bool = True, kv_cache_dtype: str = "auto"
    ) -> None:
        if kv_cache_dtype != "auto":
            raise ConfigurationError(
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the flash attention "
                "backend: flash-attn reads the KV cache in the model's dtype. Use "
                "attention_backend='triton' (or 'auto', which picks it for an FP8 KV cache), "
                "or kv_cache_dtype='auto'."
            )
        if block_size <= 0 or block_size % FLASH_BLOCK_SIZE_MULTIPLE != 0:
            raise ConfigurationError(
                f"kv_block_size={block_size} does not suit the flash attention backend: "
                f"flash-attn's paged kernels need a multiple of {FLASH_BLOCK_SIZE_MULTIPLE}. "
                f"Use kv_block_size={FLASH_BLOCK_SIZE_MULTIPLE} (or another multiple), or "
                "attention_backend='triton', which takes any multiple of 16."
            )
        flash_attn = _import_flash_attn()
        super().__init__(block_size, split_mixed_steps=split_mixed_steps)
        self._varlen = flash_attn.flash_attn_varlen_func
        self._with_kvcache = flash_attn.flash_attn_with_kvcache
        # flash-attn >= 2.6 caps the scores itself (its `softcap`; 0.0 = off).
        self.supports_softcap = _takes_softcap(self._varlen) and _takes_softcap(self._with_kvcache)

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
        assert kv_scales is None, "the flash backend refuses FP8 KV caches at construction"
        if k_cache.is_cuda:
            from pagedinfer.adapters.kernels.store_kv import store_kv_cache

            store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        else:
            store_kv_torch(key, value, k_cache, v_cache, slot_mapping)

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
        assert sinks is None, "the flash backend refuses layers with sinks at build time"
        capped = _softcap_kwargs(softcap)
        # Without a cached prefix the step's own K/V are the whole context: no page reads.
        paged = meta.has_cached_prefix
        assert paged or (key is not None and value is not None), "flash reads the step's K/V"
        output: torch.Tensor = self._varlen(
            query,
            k_cache if paged else key,
            v_cache if paged else value,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            window_size=_window_size(window),
            block_table=meta.block_tables if paged else None,
            **capped,
        )
        return _into(out, output)

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
        assert sinks is None, "the flash backend refuses layers with sinks at build time"
        capped = _softcap_kwargs(softcap)
        # Decode reads tensors only (no host values): safe to capture in a CUDA graph.
        output: torch.Tensor = self._with_kvcache(
            query.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=meta.context_lens,
            block_table=meta.block_tables,
            softmax_scale=scale,
            causal=True,
            window_size=_window_size(window),
            **capped,
        )
        return _into(out, output.squeeze(1))


def _takes_softcap(function: object) -> bool:
    """True when a flash-attn function has the ``softcap`` argument (flash-attn >= 2.6)."""
    try:
        return "softcap" in inspect.signature(function).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):  # no signature to read: assume the old API
        return False


def _softcap_kwargs(softcap: float | None) -> dict[str, float]:
    """flash-attn's ``softcap`` keyword for a capped layer; none otherwise (any version)."""
    return {"softcap": float(softcap)} if softcap else {}


def _window_size(window: int | None) -> tuple[int, int]:
    """flash-attn's ``(left, right)`` window: a query sees ``left`` keys before itself."""
    return (-1, -1) if window is None else (window - 1, 0)


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """``result``, copied into ``out`` when given (flash-attn's calls return new tensors)."""
    if out is None:
        return result
    out.copy_(result)
    return out
