"""Mistral (``MistralForCausalLM``): Llama's decoder without any bias.

Mistral 7B v0.1 declares a 4096-token ``sliding_window``: every layer then attends to the last
4096 positions only (the layers' :class:`~pagedinfer.adapters.attention.base.LayerAttentionKind`),
at any ``max_model_len``. Later Mistral checkpoints have no window. Checkpoint names are
Hugging Face's.
"""

from __future__ import annotations

from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.decoder import DecoderForCausalLM, DecoderSwitches

__all__ = ["MistralForCausalLM"]


class MistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def switches(cls, config: ModelConfig) -> DecoderSwitches:
        return DecoderSwitches(qkv_bias=False, o_proj_bias=False, qk_norm=False, mlp_bias=False)
