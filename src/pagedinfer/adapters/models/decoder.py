"""The pre-norm decoder that Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE share.

::

    tokens -> embed -> N x [ x += Attention(RMSNorm(x)); x += FeedForward(RMSNorm(x)) ]
           -> RMSNorm -> LM head (only for the rows that are sampled)

    Attention: qkv_proj -> [q_norm, k_norm: RMSNorm per head] -> RoPE -> paged attention
               -> o_proj
    FeedForward: the dense SwiGLU MLP, or (MoE layers) the sparse mixture of experts

The families differ only in what :class:`DecoderSwitches` lists (which projections carry a
bias, whether q and k are normalised per head) and in the feed-forward block a layer gets
(:meth:`DecoderForCausalLM.make_feed_forward`). Module names follow the Hugging Face
checkpoints, so most tensors load by name; packed projections are mapped by
:data:`LLAMA_STYLE_WEIGHTS`.

The residual stream is carried beside the hidden states: each norm adds the residual and
normalises in one call (:meth:`RMSNorm.add_and_norm`), the same sums in the same order as
transformers.

With pipeline parallelism (``BuildContext.parallel.stage``) a model holds only its stage's
decoder layers (the others are :class:`AbsentLayer` placeholders without parameters, so
parameter names stay the checkpoint's), the embedding on the first stage and the final norm
and LM head on the last (the embedding too when the LM head is tied to it);
:meth:`DecoderForCausalLM.forward_stage` runs one stage and :meth:`is_ignored_weight` skips
the checkpoint tensors of the other stages.

On the Triton and flash paths (``BuildContext.fused_kernels``) every layer runs fused Triton
kernels, so a decode step launches 9 kernels per layer (10 when decode attention splits the
KV): add + RMSNorm, the QKV GEMM, q/k RMSNorm + RoPE + KV store (one kernel), attention, the
output GEMM, add + RMSNorm, the gate/up GEMM, SiLU-and-mul, the down GEMM. The torch path (the
CPU) runs the same layers with their torch twins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from pagedinfer.adapters.attention.base import AttentionMetadata
from pagedinfer.adapters.distributed.pipeline import IntermediateTensors, PipelineStage
from pagedinfer.adapters.layers.attention import PagedAttention
from pagedinfer.adapters.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedinfer.adapters.layers.linear import (
    SKINNY_GEMM_IN_MODELS,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedinfer.adapters.layers.mlp import GatedMLP
from pagedinfer.adapters.layers.norm import RMSNorm
from pagedinfer.adapters.layers.rotary import RotaryEmbedding, RotaryStep
from pagedinfer.adapters.layers.sinks import head_sharded_parameter
from pagedinfer.adapters.models.base import BuildContext, CausalLM, WeightMapping
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.quantization import linear_method

__all__ = ["LLAMA_STYLE_WEIGHTS", "AbsentLayer", "DecoderForCausalLM", "DecoderSwitches"]

_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.")

LLAMA_STYLE_WEIGHTS = WeightMapping(
    packed={
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
)
"""Hugging Face's separate q/k/v and gate/up projections -> our packed ones."""


@dataclass(frozen=True, slots=True)
class DecoderSwitches:
    """What sets one family's decoder apart from another's."""

    qkv_bias: bool  # q_proj, k_proj, v_proj carry a bias
    o_proj_bias: bool
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (Qwen3)
    mlp_bias: bool  # gate, up and down projections carry a bias


class DecoderAttention(nn.Module):
    """Grouped-query attention with RoPE over the paged KV cache, split by heads across ranks."""

    def __init__(
        self,
        config: ModelConfig,
        switches: DecoderSwitches,
        build: BuildContext,
        prefix: str = "model.layers.0.self_attn",
        *,
        layer: int = 0,
    ) -> None:
        super().__init__()
        dtype, device, parallel = build.dtype, build.device, build.parallel
        kind = config.attention_kind(layer)
        head_dim = config.head_dim
        quant, kernels = config.quantization, build.fused_kernels
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            parallel=parallel,
            dtype=dtype,
            device=device,
            bias=switches.qkv_bias,
            quant=linear_method(quant, *(f"{prefix}.{p}_proj" for p in "qkv"), kernels=kernels),
            skinny_gemm=kernels and SKINNY_GEMM_IN_MODELS,
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            parallel=parallel,
            dtype=dtype,
            device=device,
            bias=switches.o_proj_bias,
            what="num_attention_heads * head_dim",
            quant=linear_method(quant, f"{prefix}.o_proj", kernels=kernels),
            skinny_gemm=kernels and SKINNY_GEMM_IN_MODELS,
        )
        # Weights only: the fused kernel or the torch twin applies them (PagedAttention).
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if switches.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype=dtype, device=device)
        # Learned attention sinks (GPT-OSS): one logit per query head, this rank's heads.
        self.sinks: nn.Parameter | None = None
        if kind.has_sinks:
            self.sinks = head_sharded_parameter(
                config.num_attention_heads, parallel, device=device, what="sinks"
            )
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            head_dim,
            scale=config.attention_scale,
            backend=build.backend,
            fused=build.fused_kernels,
            kind=kind,
        )

    def forward(
        self, hidden: torch.Tensor, rope: RotaryStep, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        out = self.attn.forward_packed(
            qkv, rope, meta, q_norm=self.q_norm, k_norm=self.k_norm, sinks=self.sinks
        )
        projected: torch.Tensor = self.o_proj(
            out.reshape(num_tokens, self.num_heads * self.head_dim)
        )
        return projected


class DecoderLayer(nn.Module):
    """``x += Attention(RMSNorm(x)); x += FeedForward(RMSNorm(x))``, residual kept apart."""

    def __init__(
        self,
        config: ModelConfig,
        switches: DecoderSwitches,
        feed_forward: nn.Module,
        build: BuildContext,
        prefix: str = "model.layers.0",
        *,
        layer: int = 0,
    ) -> None:
        super().__init__()
        dtype, device, eps = build.dtype, build.device, config.rms_norm_eps
        fused = build.fused_kernels
        self.input_layernorm = RMSNorm(
            config.hidden_size, eps, dtype=dtype, device=device, fused=fused
        )
        self.self_attn = DecoderAttention(
            config, switches, build, f"{prefix}.self_attn", layer=layer
        )
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, eps, dtype=dtype, device=device, fused=fused
        )
        self.mlp = feed_forward

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryStep,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sublayer output, residual)`` -> the same pair after this layer.

        The first layer gets ``residual=None`` and the embeddings as ``hidden``.
        """
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, rope, meta)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        out: torch.Tensor = self.mlp(hidden)
        return out, residual


class AbsentLayer(nn.Module):
    """A decoder layer another pipeline stage runs: no parameters, never called."""

    def forward(self, *args: object) -> None:
        raise AssertionError("a pipeline stage ran a decoder layer it does not hold")


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm (Hugging Face's ``model.*``).

    A pipeline stage (``stage``) holds the embedding only where it embeds (the first stage)
    or ties the LM head to it (the last), and the final norm only on the last stage.
    """

    def __init__(
        self,
        config: ModelConfig,
        layers: list[nn.Module],
        build: BuildContext,
        stage: PipelineStage | None = None,
        *,
        embed_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.stage = stage
        first = stage is None or stage.is_first
        last = stage is None or stage.is_last
        self.embed_tokens: VocabParallelEmbedding | None = None
        if first or (last and config.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                parallel=build.parallel,
                dtype=build.dtype,
                device=build.device,
            )
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_context_len,
            config.rope_theta,
            config.rope_scaling,
            device=build.device,
        )
        # Gemma 3: sliding layers rotate with their own base (the layers that do say so).
        self.local_rotary_emb: RotaryEmbedding | None = None
        if config.local_rope is not None:
            self.local_rotary_emb = RotaryEmbedding(
                config.head_dim, config.max_context_len, *config.local_rope, device=build.device
            )
        self.local_rope_layers = frozenset(
            i for i in range(config.num_hidden_layers) if config.uses_local_rope(i)
        )
        # Gemma: embeddings times sqrt(hidden_size), rounded to the model's dtype first.
        self.embed_scale: torch.Tensor | None = None
        if embed_scale is not None:
            self.embed_scale = torch.tensor(embed_scale, device=build.device).to(build.dtype)
        self.layers = nn.ModuleList(layers)
        self.fused = build.fused_kernels
        self.norm: RMSNorm | None = None
        if last:
            self.norm = RMSNorm(
                config.hidden_size,
                config.rms_norm_eps,
                dtype=build.dtype,
                device=build.device,
                fused=self.fused,
            )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        out = self.forward_stage(input_ids, positions, meta, None)
        assert isinstance(out, torch.Tensor), "the whole model ends in hidden states"
        return out

    def forward_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None,
    ) -> torch.Tensor | IntermediateTensors:
        """Embed (or continue from ``intermediate``), run this stage's layers, then the final
        norm (the last stage) or hand over hidden states and residual (the others)."""
        stage = self.stage
        residual: torch.Tensor | None = None
        if intermediate is None:
            assert self.embed_tokens is not None, "only the first stage embeds"
            hidden = self.embed_tokens(input_ids)
            if self.embed_scale is not None:
                hidden = hidden * self.embed_scale
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        rope = self.rotary_emb.step(positions, fused=self.fused)  # once, for every layer
        local_rope = rope
        if self.local_rotary_emb is not None:
            local_rope = self.local_rotary_emb.step(positions, fused=self.fused)
        start = 0 if stage is None else stage.start
        layers = self.layers if stage is None else self.layers[stage.start : stage.end]
        for index, layer in enumerate(layers, start):
            layer_rope = local_rope if index in self.local_rope_layers else rope
            hidden, residual = layer(hidden, residual, layer_rope, meta)
        assert residual is not None, "a stage has at least one layer"
        if self.norm is None:
            return IntermediateTensors(hidden, residual)
        normed, _ = self.norm.add_and_norm(hidden, residual)
        return normed


class DecoderForCausalLM(CausalLM):
    """A family of the shared decoder: subclasses say what sets them apart.

    :meth:`switches` (required) and :meth:`make_feed_forward` (the dense MLP unless
    overridden) are the only places a family differs; ``weight_mapping`` sits next to them.
    """

    weight_mapping: ClassVar[WeightMapping] = LLAMA_STYLE_WEIGHTS
    # Gemma: the embeddings are scaled by sqrt(hidden_size).
    scales_embeddings: ClassVar[bool] = False

    @classmethod
    def switches(cls, config: ModelConfig) -> DecoderSwitches:
        raise NotImplementedError

    def make_layer(
        self, config: ModelConfig, switches: DecoderSwitches, layer: int, build: BuildContext
    ) -> nn.Module:
        """Decoder layer ``layer`` (the pre-norm :class:`DecoderLayer` unless overridden)."""
        return DecoderLayer(
            config,
            switches,
            self.make_feed_forward(config, layer, build),
            build,
            prefix=f"model.layers.{layer}",
            layer=layer,
        )

    def make_feed_forward(self, config: ModelConfig, layer: int, build: BuildContext) -> nn.Module:
        """The feed-forward block of decoder layer ``layer``."""
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=self.switches(config).mlp_bias,
            parallel=build.parallel,
            dtype=build.dtype,
            device=build.device,
            fused=build.fused_kernels,
            quantization=config.quantization,
            prefix=f"model.layers.{layer}.mlp",
            activation=config.hidden_act,
        )

    def __init__(self, config: ModelConfig, build: BuildContext) -> None:
        super().__init__(config, build)
        switches = self.switches(config)
        stage = self.stage = build.parallel.stage
        held = range(config.num_hidden_layers) if stage is None else stage.layers
        layers: list[nn.Module] = [
            self.make_layer(config, switches, index, build) if index in held else AbsentLayer()
            for index in range(config.num_hidden_layers)
        ]
        embed_scale = config.hidden_size**0.5 if self.scales_embeddings else None
        self.model = DecoderModel(config, layers, build, stage, embed_scale=embed_scale)
        self.lm_head: ParallelLMHead | None = None
        if stage is None or stage.is_last:
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                parallel=build.parallel,
                dtype=build.dtype,
                device=build.device,
            )
            if config.tie_word_embeddings:
                assert self.model.embed_tokens is not None
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.model(input_ids, positions, meta)
        return hidden

    def forward_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model.forward_stage(input_ids, positions, meta, intermediate)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor | None:
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        logits: torch.Tensor | None = self.lm_head(hidden_rows)
        cap = self.config.final_logit_softcapping
        if logits is not None and cap is not None:  # Gemma: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def is_ignored_weight(self, name: str) -> bool:
        # Tied checkpoints sometimes store lm_head.weight anyway (a copy of the embedding);
        # old ones store the rotary inverse frequencies, which we compute ourselves.
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return True
        if name.endswith("rotary_emb.inv_freq") or name.startswith("score."):
            return True  # score: a classifier's head, applied by the pooling engine
        stage = self.stage
        if stage is None:
            return False
        # A pipeline stage skips what other stages hold.
        layer = _LAYER_TENSOR.match(name)
        if layer is not None:
            return int(layer[1]) not in stage.layers
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is None
        if name.startswith(("model.norm.", "lm_head.")):
            return not stage.is_last
        return False
