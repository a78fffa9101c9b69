"""Qwen3 (``Qwen3ForCausalLM``): each head of q and k RMS-normalised before RoPE.

``attention_bias`` puts a bias on q, k, v and o. Checkpoint names are Hugging Face's
(``LLAMA_STYLE_WEIGHTS``, plus ``q_norm`` / ``k_norm`` by name).
"""

from __future__ import annotations

from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.decoder import DecoderForCausalLM, DecoderSwitches

__all__ = ["Qwen3ForCausalLM"]


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def switches(cls, config: ModelConfig) -> DecoderSwitches:
        return DecoderSwitches(
            qkv_bias=config.attention_bias,
            o_proj_bias=config.attention_bias,
            qk_norm=True,
            mlp_bias=False,
        )
