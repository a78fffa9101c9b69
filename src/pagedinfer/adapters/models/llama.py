"""Llama 2, 3, 3.1, 3.2 (``LlamaForCausalLM``): the plain decoder.

``attention_bias`` puts a bias on q, k, v and o; ``mlp_bias`` on gate, up and down. Llama 3.1+
stretch RoPE with ``rope_type: llama3``; Llama 3.2 1B/3B tie the LM head to the embedding.
Checkpoint names are Hugging Face's (``LLAMA_STYLE_WEIGHTS``).
"""

from __future__ import annotations

from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.decoder import DecoderForCausalLM, DecoderSwitches

__all__ = ["LlamaForCausalLM"]


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def switches(cls, config: ModelConfig) -> DecoderSwitches:
        return DecoderSwitches(
            qkv_bias=config.attention_bias,
            o_proj_bias=config.attention_bias,
            qk_norm=False,
            mlp_bias=config.mlp_bias,
        )
