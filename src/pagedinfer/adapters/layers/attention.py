"""The attention layer: this layer's slice of the paged KV cache plus a backend call.

:meth:`PagedAttention.forward_packed` runs the whole attention from the packed QKV projection:
per-head q/k RMSNorm (Qwen3), RoPE, the KV store and attention. Three paths, chosen when the
layer is built:

* torch (``fused=False``, the CPU): the torch twins, then the backend stores and attends;
* fused with a backend that attends over stored K/V (``triton``): one Triton kernel for norm,
  RoPE and the store (:func:`~pagedinfer.adapters.kernels.qk_norm_rope.qk_norm_rope_store`),
  then the backend only attends;
* fused with another backend (``flash``): one kernel for norm and RoPE, then the backend
  stores and attends.

With an FP8 KV cache the layer also holds its scale row (``kv_scales``, bound with the cache)
and passes it to the store and attention; :meth:`PagedAttention.set_kv_scales` is the hook
through which a checkpoint's ``k_scale`` / ``v_scale`` reach the runner (see
:mod:`pagedinfer.adapters.kv_cache`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedinfer.adapters.attention.base import (
    AttendsStoredKV,
    AttentionBackend,
    AttentionMetadata,
    LayerAttentionKind,
    PagedAttentionBackend,
)
from pagedinfer.adapters.layers.norm import RMSNorm
from pagedinfer.adapters.layers.rotary import RotaryStep, qk_norm_rotate, stacked_qk_weight
from pagedinfer.errors import ConfigurationError, UnsupportedModelError

__all__ = ["PagedAttention"]

FULL_ATTENTION = LayerAttentionKind()


class PagedAttention(nn.Module):
    """Stores the step's K/V in this layer's cache pages and attends over them.

    ``k_cache`` / ``v_cache`` are views ``[num_blocks, block_size, num_kv_heads, head_dim]`` into
    the runner's single KV-cache tensor, bound with :meth:`bind_cache` once the cache exists.
    They are plain attributes, not buffers: they are not weights and must not be moved,
    copied or saved with the model. So is ``kv_scales``, the layer's row of FP8 scales
    (``[k_scale, v_scale, 1 / k_scale, 1 / v_scale]`` float32; ``None`` for a cache in the
    model's dtype).

    ``kind`` says how the layer attends (a sliding window, sinks, a logit softcap: see
    :class:`~pagedinfer.adapters.attention.base.LayerAttentionKind`); a layer with sinks gets
    its per-head sink logits (this rank's heads) with each call.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scale: float,
        backend: AttentionBackend,
        fused: bool = False,
        kind: LayerAttentionKind = FULL_ATTENTION,
    ) -> None:
        super().__init__()
        if (
            kind.has_sinks
            and isinstance(backend, PagedAttentionBackend)
            and not backend.supports_sinks
        ):
            raise ConfigurationError(
                f"attention_backend={backend.name!r} cannot add attention sinks, which this "
                "model's layers have (GPT-OSS): use attention_backend='triton' (or 'auto')."
            )
        if (
            kind.softcap is not None
            and isinstance(backend, PagedAttentionBackend)
            and not backend.supports_softcap
        ):
            raise ConfigurationError(
                f"attention_backend={backend.name!r} cannot cap attention logits, which this "
                f"model's layers do (attn_logit_softcapping={kind.softcap}): install "
                "flash-attn >= 2.6, or use attention_backend='triton' (or 'auto')."
            )
        self.kind = kind
        # Hybrid attention: the KV group whose tables and slots this layer uses (runner-set
        # with bind_cache; pagedinfer.domain.kv_groups). 0: the plan's own.
        self.kv_group = 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.fused = fused
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kv_scales: torch.Tensor | None = None
        # FP8 KV-cache scales the checkpoint carries (set_kv_scales); None: not given.
        self.checkpoint_k_scale: float | None = None
        self.checkpoint_v_scale: float | None = None
        # The fused kernels, imported only when chosen (the CPU path never imports Triton).
        # The torch path's stacked q/k norm weight, keyed by what it was built from.
        self._qk_weight: tuple[tuple[int, int, int, int], torch.Tensor] | None = None
        self._rope: Callable[..., Any] | None = None
        self._rope_store: Callable[..., Any] | None = None
        if fused:
            from pagedinfer.adapters.kernels import qk_norm_rope

            if isinstance(backend, AttendsStoredKV):
                self._rope_store = qk_norm_rope.qk_norm_rope_store
            else:
                self._rope = qk_norm_rope.qk_norm_rope

    def set_kv_scales(
        self,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Record this layer's FP8 KV-cache scales from a checkpoint (``stored = x / scale``).

        The hook for weight loaders: call it with a checkpoint's per-layer ``k_scale`` and/or
        ``v_scale`` (a float or a one-element tensor). The model runner uses them when the
        cache is FP8 and calibrates the scales a checkpoint does not give. Raises
        :class:`~pagedinfer.errors.UnsupportedModelError` for a scale that is not one finite
        number > 0.
        """
        if k_scale is not None:
            self.checkpoint_k_scale = _checked_scale("k_scale", k_scale)
        if v_scale is not None:
            self.checkpoint_v_scale = _checked_scale("v_scale", v_scale)

    def bind_cache(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
        *,
        kv_group: int = 0,
    ) -> None:
        """Bind the cache views; ``kv_group``: the KV group whose tables address them."""
        assert k_cache.shape == v_cache.shape and k_cache.dim() == 4
        assert k_cache.shape[-2:] == (self.num_kv_heads, self.head_dim), k_cache.shape
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.kv_scales = kv_scales
        self.kv_group = kv_group

    def unbind_cache(self) -> None:
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kv_scales = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query [T, heads, dim]``, ``key`` / ``value [T, kv_heads, dim]`` -> ``[T, heads, dim]``

        ``meta`` is this step's metadata, passed down explicitly from the runner; ``sinks``
        the layer's sink logits ``[heads]`` (float32) when its kind has them.
        """
        assert (sinks is not None) == self.kind.has_sinks, "sinks come with the layer's kind"
        if self.kv_group:
            meta = meta.for_group(self.kv_group)
        return self.backend.forward(
            query, key, value, self.k_cache, self.v_cache, meta, self.scale,
            kv_scales=self.kv_scales, window=self.kind.window, sinks=sinks,
            softcap=self.kind.softcap,
        )  # fmt: skip

    def forward_packed(
        self,
        qkv: torch.Tensor,
        rope: RotaryStep,
        meta: AttentionMetadata,
        *,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``qkv [T, (heads + 2 kv_heads) * dim]`` -> ``[T, heads, dim]``: q/k RMSNorm per head
        (when the norms are given), RoPE, the KV store and attention (see the module doc)."""
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_weight = q_norm.weight if q_norm is not None else None
        k_weight = k_norm.weight if k_norm is not None else None
        eps = q_norm.eps if q_norm is not None else 0.0
        if self.kv_group:  # hybrid attention: this layer's group's blocks and slots
            meta = meta.for_group(self.kv_group)
        if self._rope_store is not None:
            assert isinstance(self.backend, AttendsStoredKV)
            query: torch.Tensor = self._rope_store(
                qkv, rope.positions, rope.table_cos, rope.table_sin,
                self.k_cache, self.v_cache, meta.slot_mapping,
                num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                q_weight=q_weight, k_weight=k_weight, eps=eps, kv_scales=self.kv_scales,
            )  # fmt: skip
            return self.backend.attend(
                query, self.k_cache, self.v_cache, meta, self.scale, kv_scales=self.kv_scales,
                window=self.kind.window, sinks=sinks, softcap=self.kind.softcap,
            )  # fmt: skip
        if self._rope is not None:
            query, key = self._rope(
                qkv, rope.positions, rope.table_cos, rope.table_sin,
                num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                q_weight=q_weight, k_weight=k_weight, eps=eps,
            )  # fmt: skip
            value = qkv[:, (heads + kv_heads) * dim :].view(-1, kv_heads, dim)
        else:
            assert rope.cos is not None and rope.sin is not None, "torch path: look cos/sin up"
            qk_weight = None
            if q_weight is not None and k_weight is not None:
                qk_weight = self._stacked_qk_weight(q_weight, k_weight)
            query, key, value = qk_norm_rotate(
                qkv, rope.cos, rope.sin,
                num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                eps=eps, qk_weight=qk_weight,
            )  # fmt: skip
        return self.forward(query, key, value, meta, sinks)

    def _stacked_qk_weight(self, q_weight: torch.Tensor, k_weight: torch.Tensor) -> torch.Tensor:
        """The torch path's per-head q/k norm weights (:func:`stacked_qk_weight`), built once
        and rebuilt only when either weight is replaced or written to (its version moves)."""
        key = (q_weight.data_ptr(), q_weight._version, k_weight.data_ptr(), k_weight._version)
        if self._qk_weight is None or self._qk_weight[0] != key:
            stacked = stacked_qk_weight(q_weight, k_weight, self.num_heads, self.num_kv_heads)
            self._qk_weight = (key, stacked)
        return self._qk_weight[1]


def _checked_scale(name: str, value: float | torch.Tensor) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UnsupportedModelError(
                f"FP8 KV-cache {name} has shape {list(value.shape)}: expected one scale per "
                "layer (a per-tensor scale); per-head or per-channel KV scales are not supported."
            )
        number = float(value.reshape(()).to(torch.float32))
    else:
        number = float(value)
    if not math.isfinite(number) or number <= 0.0:
        raise UnsupportedModelError(
            f"FP8 KV-cache {name}={number} is invalid: expected a finite number > 0 "
            "(stored = x / scale)."
        )
    return number
