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
dequantized at load into the model's dtype (``adapters/quantization/mxfp4.py``): one expert
projection at a time, on the CPU, then copied into the parameter on the model's device (CUDA
included). The model then holds dense experts (bf16: four times MXFP4's bytes); a log line
says how much. Other quantization methods are refused (the experts have no quantized path).
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from pagedinfer.adapters.layers.gpt_oss_moe import GptOssMoeBlock
from pagedinfer.adapters.models.base import BuildContext
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.decoder import DecoderForCausalLM, DecoderSwitches
from pagedinfer.adapters.quantization.mxfp4 import Mxfp4Config
from pagedinfer.errors import UnsupportedModelError

__all__ = ["GptOssForCausalLM"]

_logger = logging.getLogger(__name__)

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
        super().__init__(dataclasses.replace(config, attention_sinks=True), build)
        if isinstance(config.quantization, Mxfp4Config):
            experts = [p for name, p in self.named_parameters() if ".experts." in name]
            size = sum(p.numel() * p.element_size() for p in experts)
            _logger.info(
                "%s: MXFP4 expert weights are dequantized at load to %s on %s: %.2f GiB of "
                "dense experts on this rank (MXFP4 holds about a quarter of bf16's bytes)",
                config.path, str(build.dtype).removeprefix("torch."), build.device, size / 2**30,
            )  # fmt: skip

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
