"""Gemma 3, text only (``Gemma3ForCausalLM``): sandwich norms, GELU gate, local/global layers.

What sets it apart from the shared decoder (transformers' ``modeling_gemma3``):

* the embeddings are scaled by ``sqrt(hidden_size)`` (rounded to the model's dtype);
* every RMSNorm multiplies by ``1 + weight`` (checkpoints store the offset from 1; the loader
  adds the 1, so the layers run the plain RMSNorm);
* four norms per layer: ``x += post_attn_norm(Attention(input_norm(x)))``, then
  ``x += post_ff_norm(MLP(pre_ff_norm(x)))``;
* per-head q/k RMSNorm (like Qwen3) and the scores scaled by ``query_pre_attn_scalar ** -0.5``;
* ``layer_types`` alternates sliding-window (``sliding_window``) and full-attention layers;
  sliding layers rotate with their own RoPE base (``rope_parameters.sliding_attention`` or
  ``rope_local_base_freq``), full ones with ``rope_parameters.full_attention``;
* the MLP gate is GELU (tanh approximation), ``hidden_activation``;
* ``final_logit_softcapping`` caps the logits (``cap * tanh(logits / cap)``) when set;
  ``attn_logit_softcapping`` is accepted and ignored, as transformers' ``Gemma3Attention``
  does (it stores the field and never passes it to the attention; Gemma 3 checkpoints set
  it to null). The attention kernels can cap scores (``LayerAttentionKind.softcap``), for
  an architecture whose reference applies the cap.

A ``Gemma3ForConditionalGeneration`` checkpoint (Gemma 3 4B, 12B, 27B) is served as its text
tower: ``config.json``'s ``text_config`` (``family_defaults.text_tower``), the weights under
``language_model.`` (the loader renames them), the vision tower and projector left unread.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from pagedinfer.adapters.attention.base import AttentionMetadata
from pagedinfer.adapters.layers.linear import ShardId, copy_checked, set_weight_loader
from pagedinfer.adapters.layers.norm import RMSNorm
from pagedinfer.adapters.layers.rotary import RotaryStep
from pagedinfer.adapters.models.base import BuildContext
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderSwitches,
)

__all__ = ["Gemma3ForCausalLM", "load_offset_from_one"]

_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def load_offset_from_one(norm: RMSNorm) -> RMSNorm:
    """``norm``, its weight loaded as ``1 + checkpoint tensor`` (Gemma's RMSNorm)."""

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        assert shard_id is None, f"a norm has no shards, got {shard_id!r}"
        copy_checked(param.data, loaded_weight.to(torch.float32) + 1.0)

    set_weight_loader(norm.weight, load)
    return norm


class Gemma3DecoderLayer(nn.Module):
    """One Gemma 3 layer, carrying the residual stream apart like :class:`DecoderLayer`:
    it takes and returns ``(sublayer output, residual)``; the next norm adds the two."""

    def __init__(
        self,
        config: ModelConfig,
        switches: DecoderSwitches,
        feed_forward: nn.Module,
        build: BuildContext,
        *,
        layer: int,
    ) -> None:
        super().__init__()
        fused = build.fused_kernels

        def norm() -> RMSNorm:
            return load_offset_from_one(
                RMSNorm(
                    config.hidden_size,
                    config.rms_norm_eps,
                    dtype=build.dtype,
                    device=build.device,
                    fused=fused,
                )
            )

        self.input_layernorm = norm()
        self.self_attn = DecoderAttention(
            config, switches, build, f"model.layers.{layer}.self_attn", layer=layer
        )
        for qk_norm in (self.self_attn.q_norm, self.self_attn.k_norm):
            assert qk_norm is not None, "Gemma 3 normalises q and k per head"
            load_offset_from_one(qk_norm)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        self.mlp = feed_forward

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryStep,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rope, meta))
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        out: torch.Tensor = self.post_feedforward_layernorm(self.mlp(hidden))
        return out, residual


class Gemma3ForCausalLM(DecoderForCausalLM):
    scales_embeddings: ClassVar[bool] = True

    @classmethod
    def switches(cls, config: ModelConfig) -> DecoderSwitches:
        return DecoderSwitches(
            qkv_bias=config.attention_bias,
            o_proj_bias=config.attention_bias,
            qk_norm=True,
            mlp_bias=False,
        )

    def make_layer(
        self, config: ModelConfig, switches: DecoderSwitches, layer: int, build: BuildContext
    ) -> nn.Module:
        return Gemma3DecoderLayer(
            config, switches, self.make_feed_forward(config, layer, build), build, layer=layer
        )

    def __init__(self, config: ModelConfig, build: BuildContext) -> None:
        super().__init__(config, build)
        if self.model.norm is not None:
            load_offset_from_one(self.model.norm)

    def is_ignored_weight(self, name: str) -> bool:
        # A Gemma3ForConditionalGeneration checkpoint: its text tower is served, the vision
        # tower and the projector of image embeddings are not read.
        return name.startswith(_VISION_PREFIXES) or super().is_ignored_weight(name)
