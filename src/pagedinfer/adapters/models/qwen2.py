"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): biases on q, k and v (not o), no q/k norm.

Checkpoint names are Hugging Face's (``LLAMA_STYLE_WEIGHTS``).
"""

from __future__ import annotations

from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.decoder import DecoderForCausalLM, DecoderSwitches

__all__ = ["Qwen2ForCausalLM"]


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def switches(cls, config: ModelConfig) -> DecoderSwitches:
        return DecoderSwitches(qkv_bias=True, o_proj_bias=False, qk_norm=False, mlp_bias=False)
