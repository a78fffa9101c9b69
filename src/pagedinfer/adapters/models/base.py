"""What the model runner and the weight loader expect of a causal language model.

A model is built from its :class:`~pagedinfer.adapters.models.config.ModelConfig` and a
:class:`BuildContext` (rank, attention backend, parameter dtype and device: everything is
passed explicitly, nothing is read from torch's process-wide defaults). Its
:class:`WeightMapping` says how checkpoint tensor names become parameter names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from pagedinfer.adapters.attention.base import AttentionBackend, AttentionMetadata
from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.distributed.pipeline import IntermediateTensors
from pagedinfer.adapters.layers.attention import PagedAttention
from pagedinfer.adapters.layers.linear import ShardId
from pagedinfer.adapters.models.config import ModelConfig

__all__ = ["BuildContext", "CausalLM", "WeightMapping"]


@dataclass(frozen=True, slots=True)
class BuildContext:
    """Where and how a model's modules are created, besides its config."""

    parallel: ParallelContext
    backend: AttentionBackend
    dtype: torch.dtype
    device: torch.device

    @property
    def fused_kernels(self) -> bool:
        """Layers run the fused Triton kernels (norms, RoPE, SiLU-and-mul, MoE) on the Triton
        and flash paths (CUDA, or the CPU under ``TRITON_INTERPRET=1``); the torch path (the
        CPU) runs their torch twins and never imports Triton."""
        return self.backend.name != "torch"


# A checkpoint's per-expert tensor: "<prefix>.experts.<e>.<gate_proj|up_proj|down_proj>.weight".
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_EXPERT_PARAM = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<param>gate_up_proj|down_proj)$")


@dataclass(frozen=True, slots=True)
class WeightMapping:
    """Checkpoint tensor names <-> ``(parameter name, shard id)``.

    ``packed`` renames a checkpoint module whose tensor is one shard of a packed parameter
    (``q_proj -> (qkv_proj, "q")``). With ``experts``, per-expert tensors
    (``mlp.experts.3.up_proj.weight``) fill the stacked expert parameters of
    :class:`~pagedinfer.adapters.layers.mlp.ExpertWeights`.
    """

    packed: Mapping[str, tuple[str, ShardId]] = field(default_factory=dict)
    experts: bool = False

    def to_parameter(self, name: str) -> tuple[str, ShardId]:
        """Checkpoint tensor name -> (parameter name, shard id)."""
        if self.experts and (match := _EXPERT_TENSOR.match(name)):
            prefix, expert, proj = match["prefix"], int(match["expert"]), match["proj"]
            if proj == "gate_proj":
                return f"{prefix}.gate_up_proj", (expert, 0)
            if proj == "up_proj":
                return f"{prefix}.gate_up_proj", (expert, 1)
            if proj == "down_proj":
                return f"{prefix}.down_proj", expert
        for checkpoint_module, (packed_module, shard_id) in self.packed.items():
            part = f".{checkpoint_module}."
            if part in name:
                return name.replace(part, f".{packed_module}.", 1), shard_id
        return name, None

    def to_checkpoint(self, param_name: str, shard_id: ShardId) -> str:
        """(parameter name, shard id) -> the checkpoint tensor name that fills it."""
        if self.experts and (match := _EXPERT_PARAM.match(param_name)):
            if isinstance(shard_id, tuple):
                expert, index = shard_id
                return f"{match['prefix']}.{expert}.{('gate_proj', 'up_proj')[index]}.weight"
            return f"{match['prefix']}.{shard_id}.down_proj.weight"
        for checkpoint_module, (packed_module, packed_shard) in self.packed.items():
            packed_part = f".{packed_module}."
            if packed_shard == shard_id and packed_part in param_name:
                return param_name.replace(packed_part, f".{checkpoint_module}.", 1)
        return param_name


class CausalLM(nn.Module):
    """A decoder-only model over a paged KV cache."""

    weight_mapping: ClassVar[WeightMapping] = WeightMapping()

    def __init__(self, config: ModelConfig, build: BuildContext) -> None:
        super().__init__()
        self.config = config
        self.parallel = build.parallel

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Raise :class:`~pagedinfer.errors.UnsupportedModelError` if this class cannot run
        ``config`` (a family that needs fields others do not, e.g. MoE)."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` -> final hidden states ``[T, hidden]``."""
        raise NotImplementedError

    def forward_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None,
    ) -> torch.Tensor | IntermediateTensors:
        """One pipeline stage (``build.parallel.stage``): the first stage embeds
        ``input_ids``, the others continue from the previous stage's ``intermediate``; the
        last stage returns the final hidden states, the others their intermediate tensors."""
        raise NotImplementedError(f"{type(self).__name__} cannot run as a pipeline stage")

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor | None:
        """``[n, hidden]`` -> logits ``[n, vocab]`` on the driver rank, None on the others."""
        raise NotImplementedError

    def attention_layers(self) -> list[PagedAttention]:
        """The attention layers in layer order (layer ``i`` uses KV-cache slice ``i``)."""
        return [module for module in self.modules() if isinstance(module, PagedAttention)]

    def is_ignored_weight(self, name: str) -> bool:
        """Checkpoint tensors that are legitimately unused (e.g. a tied ``lm_head``)."""
        return False
