"""Learned attention sinks (GPT-OSS): one logit per query head, split by heads across ranks.

A sink is an extra logit in each head's softmax denominator with no value: attention mass a
head may give to "nothing". Checkpoints store ``self_attn.sinks`` as ``[num_attention_heads]``;
each tensor-parallel rank keeps its heads' slice, in float32 (what the kernels read).
"""

from __future__ import annotations

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

__all__ = ["head_sharded_parameter"]


def head_sharded_parameter(
    num_heads: int, parallel: ParallelContext, *, device: torch.device, what: str
) -> nn.Parameter:
    """A float32 ``[num_heads / world_size]`` parameter filled from a ``[num_heads]``
    checkpoint tensor (this rank's contiguous slice of heads)."""
    per_rank = divide(num_heads, parallel.world_size, what="num_attention_heads")
    param = empty_parameter(per_rank, dtype=torch.float32, device=device)
    start = parallel.rank * per_rank

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        assert shard_id is None, f"{what} has no shards, got {shard_id!r}"
        copy_checked(param.data, loaded_weight.narrow(0, start, per_rank))

    set_weight_loader(param, load, lambda _shard: (num_heads,))
    return param
