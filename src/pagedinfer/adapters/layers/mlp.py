"""The decoder's feed-forward blocks: the dense SwiGLU MLP and, beside it, the sparse MoE.

Dense (every token through one MLP)::

    x -> gate_up_proj (column parallel, [gate | up]) -> silu(gate) * up -> down_proj (row
    parallel, all-reduce)

Sparse mixture of experts (Qwen3-MoE): a replicated router scores ``num_experts`` experts per
token; each token goes through its ``top_k`` best experts (each a SwiGLU MLP) and their outputs
are summed, weighted by the router's softmax probabilities (renormalised over the top k when
``norm_topk_prob``). With tensor parallelism every expert is split like the dense MLP (its
intermediate features across ranks), so all ranks do the same work whatever the routing.

The experts run either in :func:`moe_experts_torch` (the reference: a loop over the experts
that received tokens) or in the fused Triton kernel of ``adapters/kernels/moe.py`` (tokens
sorted by expert, one grouped GEMM per projection).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.layers.activation import gated_activation
from pagedinfer.adapters.layers.linear import (
    SKINNY_GEMM_IN_MODELS,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    ShardId,
    copy_checked,
    divide,
    empty_parameter,
    set_weight_loader,
)
from pagedinfer.adapters.quantization import QuantizationConfig, linear_method

__all__ = ["ExpertWeights", "GatedMLP", "SparseMoeBlock", "moe_experts_torch", "select_experts"]

ExpertsFunction = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
"""``(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k])``
-> ``[T, H]``: the weighted sum of every token's experts."""


class GatedMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up packed in one projection
    (``activation="gelu_pytorch_tanh"``: Gemma's GELU-tanh gate instead of SiLU).

    With ``quantization``, the projections hold that checkpoint format's tensors; ``prefix``
    is the MLP's checkpoint module (``model.layers.<i>.mlp``), for its ignore list and
    messages.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool = False,
        quantization: QuantizationConfig | None = None,
        prefix: str = "model.layers.0.mlp",
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size, intermediate_size],
            parallel=parallel,
            dtype=dtype,
            device=device,
            bias=bias,
            quant=linear_method(
                quantization, f"{prefix}.gate_proj", f"{prefix}.up_proj", kernels=fused
            ),
            skinny_gemm=fused and SKINNY_GEMM_IN_MODELS,
        )
        self.act = gated_activation(activation, fused=fused)  # fused SiLU: one Triton kernel
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            parallel=parallel,
            dtype=dtype,
            device=device,
            bias=bias,
            what="intermediate_size",
            quant=linear_method(quantization, f"{prefix}.down_proj", kernels=fused),
            skinny_gemm=fused and SKINNY_GEMM_IN_MODELS,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)))
        return out


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k], expert ids [T, k])``: the top-k experts by softmax probability.

    The softmax runs in float32 and the weights are cast back to the logits' dtype, as in
    transformers.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def moe_experts_torch(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The reference experts: each expert that received tokens runs on exactly those tokens.

    Every token's contributions are added in ascending expert order, as transformers does.
    """
    top_k = topk_ids.shape[1]
    out = torch.zeros_like(hidden)
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)  # (token, k) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    flat_weights = topk_weights.flatten()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(hidden[tokens], w13[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, w2[expert]) * flat_weights[pairs, None]
        out.index_add_(0, tokens, expert_out.to(out.dtype))
    return out


class ExpertWeights(nn.Module):
    """Every expert's projections stacked, this rank's slice of each expert.

    ``gate_up_proj [E, 2 * I / world, H]`` (gate rows, then up rows) and
    ``down_proj [E, H, I / world]``. Checkpoints store each expert's ``gate_proj``,
    ``up_proj`` and ``down_proj`` apart; their shard ids are ``(expert, 0)``, ``(expert, 1)``
    and ``expert``.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.local_size = divide(intermediate_size, parallel.world_size, "moe_intermediate_size")
        self.gate_up_proj = empty_parameter(
            num_experts, 2 * self.local_size, hidden_size, dtype=dtype, device=device
        )
        set_weight_loader(
            self.gate_up_proj,
            self._load_gate_up,
            lambda shard_id: (intermediate_size, hidden_size),
            [(expert, part) for expert in range(num_experts) for part in (0, 1)],
        )
        self.down_proj = empty_parameter(
            num_experts, hidden_size, self.local_size, dtype=dtype, device=device
        )
        set_weight_loader(
            self.down_proj,
            self._load_down,
            lambda shard_id: (hidden_size, intermediate_size),
            list(range(num_experts)),
        )

    def _load_gate_up(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        assert isinstance(shard_id, tuple), f"gate/up shard id is (expert, part): {shard_id!r}"
        expert, part = shard_id
        size = self.local_size
        source = loaded_weight.narrow(0, self.parallel.rank * size, size)
        copy_checked(param.data[expert].narrow(0, part * size, size), source)

    def _load_down(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        assert isinstance(shard_id, int), f"down shard id is the expert: {shard_id!r}"
        size = self.local_size
        copy_checked(param.data[shard_id], loaded_weight.narrow(1, self.parallel.rank * size, size))


class SparseMoeBlock(nn.Module):
    """Router plus experts (see the module docstring); ``fused`` picks the Triton kernel."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        fused: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = ReplicatedLinear(
            hidden_size, num_experts, parallel=parallel, dtype=dtype, device=device
        )
        self.experts = ExpertWeights(
            num_experts,
            hidden_size,
            intermediate_size,
            parallel=parallel,
            dtype=dtype,
            device=device,
        )
        self.run_experts: ExpertsFunction = moe_experts_torch
        if fused:  # Triton is imported only when the fused path is chosen
            kernels = importlib.import_module("pagedinfer.adapters.kernels.moe")
            self.run_experts = kernels.fused_moe

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits: torch.Tensor = self.gate(hidden)
        weights, ids = select_experts(router_logits, self.top_k, self.norm_topk_prob)
        out = self.run_experts(
            hidden, self.experts.gate_up_proj, self.experts.down_proj, weights, ids
        )
        return self.parallel.all_reduce(out)
