"""The flash backend and capped attention logits, with a stand-in flash_attn module: the cap
reaches flash-attn's ``softcap`` where its API has one, and layers with a cap are refused
when it does not (flash-attn < 2.6)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from pagedinfer.adapters.attention.base import AttentionMetadata, LayerAttentionKind
from pagedinfer.adapters.attention.flash import FlashAttentionBackend
from pagedinfer.adapters.layers.attention import PagedAttention
from pagedinfer.errors import ConfigurationError


def _fake_flash_attn(with_softcap: bool, calls: list[dict[str, Any]]) -> types.ModuleType:
    def varlen_new(q: torch.Tensor, k: Any, v: Any, *, softcap: float = 0.0, **kw: Any) -> Any:
        calls.append({"softcap": softcap, **kw})
        return torch.zeros_like(q)

    def varlen_old(q: torch.Tensor, k: Any, v: Any, **kw: Any) -> Any:
        assert "softcap" not in kw
        calls.append(kw)
        return torch.zeros_like(q)

    def kvcache_new(q: torch.Tensor, k: Any, v: Any, *, softcap: float = 0.0, **kw: Any) -> Any:
        calls.append({"softcap": softcap, **kw})
        return torch.zeros_like(q)

    def kvcache_old(q: torch.Tensor, k: Any, v: Any, **kw: Any) -> Any:
        calls.append(kw)
        return torch.zeros_like(q)

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = varlen_new if with_softcap else varlen_old  # type: ignore[attr-defined]
    module.flash_attn_with_kvcache = kvcache_new if with_softcap else kvcache_old  # type: ignore[attr-defined]
    return module


def _layer(backend: FlashAttentionBackend, softcap: float | None) -> PagedAttention:
    kind = LayerAttentionKind(window=4, softcap=softcap)
    return PagedAttention(2, 1, 8, scale=1.0, backend=backend, kind=kind)


def test_old_flash_attn_refuses_capped_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn(False, []))
    backend = FlashAttentionBackend(256)
    assert not backend.supports_softcap
    _layer(backend, None)  # uncapped layers are fine
    with pytest.raises(ConfigurationError, match=r"cannot cap attention logits.*2\.6"):
        _layer(backend, 30.0)


def test_the_cap_reaches_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn(True, calls))
    backend = FlashAttentionBackend(256)
    assert backend.supports_softcap
    cache = torch.zeros(2, 256, 1, 8)
    meta = AttentionMetadata(
        is_prefill=False, block_size=256, slot_mapping=torch.tensor([3]),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32),
        context_lens=torch.tensor([4], dtype=torch.int32),
        block_tables=torch.tensor([[1]], dtype=torch.int32),
        max_seqlen_q=1, max_seqlen_k=4, has_cached_prefix=True,
    )  # fmt: skip
    query, key = torch.zeros(1, 2, 8), torch.zeros(1, 1, 8)
    for softcap in (30.0, None):
        backend.forward(query, key, key, cache, cache, meta, 1.0, window=4, softcap=softcap)
    assert [call["softcap"] for call in calls] == [30.0, 0.0]
    assert calls[0]["window_size"] == (3, 0)
