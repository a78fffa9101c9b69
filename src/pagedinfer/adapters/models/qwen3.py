"""Qwen3: pre-norm decoder blocks of (QK-normed, rotary, grouped-query) attention and SwiGLU.

::

    tokens -> embed -> N x [ x += Attention(RMSNorm(x)); x += SwiGLU(RMSNorm(x)) ] -> RMSNorm
           -> LM head (only for the rows that are sampled)

    Attention: qkv_proj -> q_norm, k_norm (RMSNorm per head) -> RoPE -> paged attention -> o_proj

Module names follow the Hugging Face checkpoint, so most tensors load by name; the packed
projections are mapped by :attr:`Qwen3ForCausalLM.packed_modules_mapping`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from pagedinfer.adapters.attention.base import AttentionBackend, AttentionMetadata
from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.layers.activation import SiluAndMul
from pagedinfer.adapters.layers.attention import PagedAttention
from pagedinfer.adapters.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedinfer.adapters.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardId,
)
from pagedinfer.adapters.layers.norm import RMSNorm
from pagedinfer.adapters.layers.rotary import RotaryEmbedding, apply_rotary
from pagedinfer.adapters.models.base import CausalLM
from pagedinfer.adapters.models.config import ModelConfig

__all__ = ["Qwen3ForCausalLM"]


class Qwen3Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, *, parallel: ParallelContext, backend: AttentionBackend
    ) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            parallel=parallel,
            bias=config.attention_bias,
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            parallel=parallel,
            bias=config.attention_bias,
            what="num_attention_heads * head_dim",
        )
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, head_dim, scale=head_dim**-0.5, backend=backend
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        # Qwen3 normalises each head of q and k before the rotary embedding.
        q = apply_rotary(self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rotary(
            self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim)), cos, sin
        )
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out: torch.Tensor = self.attn(q, k, v, meta)
        projected: torch.Tensor = self.o_proj(out.reshape(num_tokens, q_size))
        return projected


class Qwen3MLP(nn.Module):
    def __init__(self, config: ModelConfig, *, parallel: ParallelContext) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], parallel=parallel
        )
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, parallel=parallel, what="intermediate_size"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)))
        return out


class Qwen3DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, *, parallel: ParallelContext, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, parallel=parallel, backend=backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen3MLP(config, parallel=parallel)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # The sublayer outputs are fresh tensors, so the residual adds can be in place.
        attended: torch.Tensor = self.self_attn(self.input_layernorm(hidden), cos, sin, meta)
        hidden = attended.add_(hidden)
        mlp_out: torch.Tensor = self.mlp(self.post_attention_layernorm(hidden))
        return mlp_out.add_(hidden)


class Qwen3Model(nn.Module):
    def __init__(
        self, config: ModelConfig, *, parallel: ParallelContext, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, parallel=parallel
        )
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta
        )
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, parallel=parallel, backend=backend)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)  # looked up once, shared by every layer
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, meta)
        normed: torch.Tensor = self.norm(hidden)
        return normed


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 for generation: hidden states for every token, logits for the sampled rows."""

    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, ShardId]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, config: ModelConfig, *, parallel: ParallelContext, backend: AttentionBackend
    ) -> None:
        super().__init__(config, parallel=parallel, backend=backend)
        self.model = Qwen3Model(config, parallel=parallel, backend=backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel=parallel)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.model(input_ids, positions, meta)
        return hidden

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor | None:
        logits: torch.Tensor | None = self.lm_head(hidden_rows)
        return logits

    def is_ignored_weight(self, name: str) -> bool:
        # Tied checkpoints sometimes store lm_head.weight anyway (a copy of the embedding);
        # old ones store the rotary inverse frequencies, which we compute ourselves.
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return True
        return name.endswith("rotary_emb.inv_freq")
