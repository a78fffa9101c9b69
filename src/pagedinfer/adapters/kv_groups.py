"""The KV groups of a model on this runner: its attention layers grouped by window.

The domain's :mod:`pagedinfer.domain.kv_groups` decides the layout; this reads each layer's
window (its :class:`~pagedinfer.adapters.attention.base.LayerAttentionKind`) and says when the
runner uses groups at all:

* a window at least ``max_model_len`` never leaves anything out: such layers count as full;
* one kind of layer (every model without a window, or every layer with the same window):
  one group, which is the plain cache (``None``);
* pipeline parallelism and the Ray executor keep one table per sequence (their stages and
  actors size and address the cache per stage; groups are not wired there): correct, every
  layer in every block, without the memory saving.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedinfer.adapters.layers.attention import PagedAttention
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain.kv_groups import KVGroupLayout, group_layers, is_plain

__all__ = ["runner_kv_layout"]


def runner_kv_layout(
    layers: Sequence[PagedAttention], config: RunnerConfig
) -> KVGroupLayout | None:
    """The layout of ``layers``' KV groups, or ``None`` for one table per sequence."""
    windows = [
        None
        if layer.kind.window is None or layer.kind.window >= config.max_model_len
        else layer.kind.window
        for layer in layers
    ]
    if not windows:
        return None
    groups = group_layers(windows)
    if is_plain(groups):
        return None
    if config.pipeline_parallel_size > 1 or config.distributed_executor_backend == "ray":
        return None
    return KVGroupLayout.of(groups)
