"""GPT-OSS (``GptOssForCausalLM``): sinks, alternating sliding/full layers, a biased MoE.

What sets it apart from the shared decoder (transformers' ``modeling_gpt_oss``):

* every attention layer has learned sinks (``self_attn.sinks``, one logit per head added to
  the softmax's denominator) and biased q/k/v/o projections (``attention_bias``);
* ``layer_types`` alternates sliding-window (``sliding_window``, 128) and full layers;
* YaRN RoPE (``rope_parameters``, read like every family's);
* every layer's feed-forward block is :class:`~pagedinfer.adapters.layers.gpt_oss_moe.
  GptOssMoeBlock`: a biased router over ``num_local_experts`` experts, ``num_experts_per_tok``
  per token, clamped SwiGLU experts (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0) with biases.

MXFP4 checkpoints (``quantization_config.quant_method == "mxfp4"``, the released weights) are
dequantized at load into the model's dtype on the CPU (``adapters/quantization/mxfp4.py``);
on CUDA they are refused (no MXFP4 kernel): dequantize them first, or run on the CPU. Other
quantization methods are refused (the experts have no quantized path).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from pagedinfer.adapters.layers.gpt_oss_moe import GptOssMoeBlock
from pagedinfer.adapters.models.base import BuildContext
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.decoder import DecoderForCausalLM, DecoderSwitches
from pagedinfer.adapters.quantization.mxfp4 import Mxfp4Config
from pagedinfer.errors import ConfigurationError, UnsupportedModelError

__all__ = ["GptOssForCausalLM"]

SWIGLU_ALPHA = 1.702  # transformers' default swiglu_alpha


class GptOssForCausalLM(DecoderForCausalLM):
    @classmethod
    def switches(cls, config: ModelConfig) -> DecoderSwitches:
        return DecoderSwitches(
            qkv_bias=config.attention_bias,
            o_proj_bias=config.attention_bias,
            qk_norm=False,
            mlp_bias=False,
        )

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        if config.moe is None:
            raise UnsupportedModelError(
                f"checkpoint {str(config.path)!r}: GptOssForCausalLM needs num_local_experts "
                "and num_experts_per_tok in config.json."
            )
        if config.quantization is not None and not isinstance(config.quantization, Mxfp4Config):
            raise UnsupportedModelError(
                f"checkpoint {str(config.path)!r}: quantized GPT-OSS checkpoints "
                f"({config.quantization.describe()}) are not supported: the experts have no "
                "quantized path. Dequantize to bf16 first (transformers: "
                "Mxfp4Config(dequantize=True), then save_pretrained)."
            )

    def __init__(self, config: ModelConfig, build: BuildContext) -> None:
        if isinstance(config.quantization, Mxfp4Config) and build.device.type != "cpu":
            raise ConfigurationError(
                f"checkpoint {str(config.path)!r}: MXFP4 expert weights (quant_method "
                f"'mxfp4') are dequantized at load on the CPU only, not on {build.device}: "
                "run with device='cpu', or dequantize the checkpoint first (transformers: "
                "load it with Mxfp4Config(dequantize=True), then save_pretrained) and serve "
                "the bf16 copy."
            )
        super().__init__(dataclasses.replace(config, attention_sinks=True), build)

    def make_feed_forward(self, config: ModelConfig, layer: int, build: BuildContext) -> nn.Module:
        moe = config.moe
        assert moe is not None, "check_config ran before the model was built"
        return GptOssMoeBlock(
            config.hidden_size,
            moe.moe_intermediate_size,
            num_experts=moe.num_experts,
            top_k=moe.num_experts_per_tok,
            alpha=SWIGLU_ALPHA if config.swiglu_alpha is None else config.swiglu_alpha,
            limit=config.swiglu_limit if config.swiglu_limit is not None else float("inf"),
            fused=build.fused_kernels,
            parallel=build.parallel,
            dtype=build.dtype,
            device=build.device,
        )
