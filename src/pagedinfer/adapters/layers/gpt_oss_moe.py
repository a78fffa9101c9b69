"""GPT-OSS's mixture of experts: a biased router and biased, clamped SwiGLU experts.

As transformers' ``modeling_gpt_oss``: the router's logits (``router.weight``, ``router.bias``)
pick each token's ``top_k`` experts by logit, weighted by the softmax of those ``top_k``
logits. An expert computes ``gate_up = x @ gate_up_proj + gate_up_proj_bias`` (gate and up
interleaved: even columns gate, odd ones up), clamps ``gate <= limit`` and ``-limit <= up <=
limit``, then ``(up + 1) * gate * sigmoid(alpha * gate)`` and ``@ down_proj + down_proj_bias``.
Checkpoint layouts are kept (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``).

The experts run either in :func:`gpt_oss_experts_torch` (the reference, a loop over the
experts that received tokens: the CPU path) or, with ``fused`` (the Triton and flash paths),
in :func:`~pagedinfer.adapters.kernels.moe.fused_gpt_oss_moe`: tokens sorted by expert, one
grouped GEMM per projection with the biases in its epilogue, the clamped SwiGLU between
them; no host synchronisation, so it runs inside CUDA graphs.

Tensor parallelism splits every expert's intermediate features: a rank keeps a contiguous
slice of the interleaved ``2I`` columns (whole gate/up pairs) and the matching rows of
``down_proj``; the down bias is added on rank 0 only, before the all-reduce.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch
from torch import nn

from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.layers.linear import (
    ShardId,
    copy_checked,
    divide,
    empty_parameter,
    set_weight_loader,
)

__all__ = [
    "GptOssExperts",
    "GptOssExpertsFunction",
    "GptOssMoeBlock",
    "GptOssRouter",
    "clamped_swiglu",
    "gpt_oss_experts_torch",
]


class GptOssExpertsFunction(Protocol):
    """``(hidden [T, H], gate_up_proj [E, H, 2I], gate_up_bias [E, 2I], down_proj [E, I, H],
    down_bias [E, H] | None, topk_weights [T, k], topk_ids [T, k], *, alpha, limit)`` ->
    ``[T, H]``: the weighted sum of every token's experts."""

    def __call__(
        self,
        hidden: torch.Tensor,
        gate_up_proj: torch.Tensor,
        gate_up_bias: torch.Tensor,
        down_proj: torch.Tensor,
        down_bias: torch.Tensor | None,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        alpha: float,
        limit: float,
    ) -> torch.Tensor: ...


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``[..., 2I]`` interleaved gate/up -> ``[..., I]`` (see the module docstring)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssRouter(nn.Module):
    """``router.weight [E, H]`` and ``router.bias [E]``, replicated on every rank."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = empty_parameter(num_experts, hidden_size, dtype=dtype, device=device)
        self.bias = empty_parameter(num_experts, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], expert ids [T, k])``."""
        logits = torch.nn.functional.linear(hidden, self.weight, self.bias)
        top_values, top_ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top_values, dim=1, dtype=top_values.dtype), top_ids


class GptOssExperts(nn.Module):
    """Every expert's projections and biases, this rank's slice of the intermediate features."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        alpha: float,
        limit: float,
        fused: bool = False,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.alpha, self.limit, self.parallel = alpha, limit, parallel
        self.run_experts: GptOssExpertsFunction = gpt_oss_experts_torch
        # The torch loop reads each expert's token count on the host (a sync), which a CUDA
        # graph cannot capture (adapters/cuda_graph.py, reads_device_values_on_host); the
        # fused path reads nothing on the host.
        self.reads_device_values_on_host = not fused
        if fused:  # Triton is imported only when the fused path is chosen
            kernels = importlib.import_module("pagedinfer.adapters.kernels.moe")
            self.run_experts = kernels.fused_gpt_oss_moe
        local = divide(intermediate_size, parallel.world_size, "intermediate_size")
        self.local_size = local
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = empty_parameter(e, h, 2 * local, dtype=dtype, device=device)
        self.gate_up_proj_bias = empty_parameter(e, 2 * local, dtype=dtype, device=device)
        self.down_proj = empty_parameter(e, local, h, dtype=dtype, device=device)
        self.down_proj_bias = empty_parameter(e, h, dtype=dtype, device=device)
        start = parallel.rank * local
        for param, axis, full, size, offset in (
            (self.gate_up_proj, 2, (e, h, 2 * i), 2 * local, 2 * start),
            (self.gate_up_proj_bias, 1, (e, 2 * i), 2 * local, 2 * start),
            (self.down_proj, 1, (e, i, h), local, start),
        ):
            set_weight_loader(param, _narrowing(axis, offset, size), _shape(full))

    def forward(
        self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        down_bias = self.down_proj_bias if self.parallel.rank == 0 else None
        return self.run_experts(
            hidden, self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, down_bias,
            weights, ids, alpha=self.alpha, limit=self.limit,
        )  # fmt: skip


def gpt_oss_experts_torch(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """The reference experts ``[T, H]``: each expert that received tokens runs on exactly
    those tokens, their contributions added in ascending expert order (as transformers).

    Its expert counts come to the host (``tolist``): the CPU path, and the oracle of the
    Triton path (:func:`~pagedinfer.adapters.kernels.moe.fused_gpt_oss_moe`, the same
    arguments), which never waits for the host.
    """
    out = torch.zeros_like(hidden)
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up_proj.shape[0]).tolist()
    flat_weights = topk_weights.flatten()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate_up = hidden[tokens] @ gate_up_proj[expert] + gate_up_bias[expert]
        expert_out = clamped_swiglu(gate_up, alpha, limit) @ down_proj[expert]
        if down_bias is not None:
            expert_out = expert_out + down_bias[expert]
        out.index_add_(0, tokens, (expert_out * flat_weights[pairs, None]).to(out.dtype))
    return out


def _narrowing(axis: int, offset: int, size: int):  # type: ignore[no-untyped-def]
    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        assert shard_id is None, f"expert tensors are loaded whole, got {shard_id!r}"
        copy_checked(param.data, loaded_weight.narrow(axis, offset, size))

    return load


def _shape(full: tuple[int, ...]):  # type: ignore[no-untyped-def]
    return lambda _shard: full


class GptOssMoeBlock(nn.Module):
    """``mlp.router`` plus ``mlp.experts`` (checkpoint names), summed across ranks."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        num_experts: int,
        top_k: int,
        alpha: float,
        limit: float,
        fused: bool = False,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.router = GptOssRouter(hidden_size, num_experts, top_k, dtype=dtype, device=device)
        self.experts = GptOssExperts(
            num_experts, hidden_size, intermediate_size, alpha=alpha, limit=limit, fused=fused,
            parallel=parallel, dtype=dtype, device=device,
        )  # fmt: skip

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(hidden)
        return self.parallel.all_reduce(self.experts(hidden, weights, ids))
