"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention, sparse experts in the MLP slot.

Layer ``i`` uses the experts unless it is in ``mlp_only_layers`` or ``(i + 1)`` is not a
multiple of ``decoder_sparse_step``; those layers get the dense MLP of ``intermediate_size``.
Routing: softmax over ``num_experts``, the top ``num_experts_per_tok``, renormalised when
``norm_topk_prob``. The experts run in the fused Triton kernel (``adapters/kernels/moe.py``)
on the Triton and flash paths, and in the torch reference on the torch path (the CPU).

Checkpoint names: the router is ``mlp.gate.weight``; experts are stored one by one
(``mlp.experts.<e>.{gate,up,down}_proj.weight``) and stacked on load.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from pagedinfer.adapters.layers.mlp import SparseMoeBlock
from pagedinfer.adapters.models.base import BuildContext, WeightMapping
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.decoder import LLAMA_STYLE_WEIGHTS
from pagedinfer.adapters.models.qwen3 import Qwen3ForCausalLM
from pagedinfer.errors import UnsupportedModelError

__all__ = ["Qwen3MoeForCausalLM"]


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    weight_mapping: ClassVar[WeightMapping] = WeightMapping(
        packed=LLAMA_STYLE_WEIGHTS.packed, experts=True
    )

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        if config.moe is None:
            raise UnsupportedModelError(
                f"checkpoint {str(config.path)!r}: Qwen3MoeForCausalLM needs num_experts, "
                "num_experts_per_tok and moe_intermediate_size in config.json."
            )
        if config.hidden_act != "silu":
            raise UnsupportedModelError(
                f"checkpoint {str(config.path)!r}: hidden_act={config.hidden_act!r} is not "
                "supported for Qwen3-MoE's experts: expected 'silu'."
            )
        if config.quantization is not None:
            raise UnsupportedModelError(
                f"checkpoint {str(config.path)!r}: quantized Qwen3-MoE checkpoints "
                f"({config.quantization.describe()}) are not supported: the experts have no "
                "quantized path; use the unquantized checkpoint."
            )

    def make_feed_forward(self, config: ModelConfig, layer: int, build: BuildContext) -> nn.Module:
        moe = config.moe
        assert moe is not None, "check_config ran before the model was built"
        if not moe.is_sparse(layer):
            return super().make_feed_forward(config, layer, build)
        return SparseMoeBlock(
            config.hidden_size,
            moe.moe_intermediate_size,
            num_experts=moe.num_experts,
            top_k=moe.num_experts_per_tok,
            norm_topk_prob=moe.norm_topk_prob,
            fused=build.fused_kernels,
            parallel=build.parallel,
            dtype=build.dtype,
            device=build.device,
        )
