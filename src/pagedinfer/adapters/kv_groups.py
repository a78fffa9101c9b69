"""The KV groups of a model on this runner: its attention layers grouped by window.

The domain's :mod:`pagedinfer.domain.kv_groups` decides the layout; this reads every decoder
layer's window (its :class:`~pagedinfer.adapters.attention.base.LayerAttentionKind`, from the
model config) and says when the runner uses groups at all, and where the layers *this runner
holds* live in its cache:

* a window at least ``max_model_len`` never leaves anything out: such layers count as full;
* one kind of layer (every model without a window, or every layer with the same window):
  one group, which is the plain cache (``None``);
* the groups are always those of the *whole* model (every layer, in layer order), so every
  tensor-parallel rank and every pipeline stage hands the scheduler the same layout: the
  scheduler's tables are valid on each of them;
* a runner holding only some layers (a pipeline stage) keeps, in each block, only its own
  layers of the block's group: layer ``l`` of group ``g`` takes the slot of its position
  among the held layers of ``g``, and a block holds as many layers as the largest share of a
  group this runner holds (:attr:`RunnerKVLayout.layers_per_block`). A whole-model runner's
  slots are the domain layout's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedinfer.adapters.attention.base import LayerAttentionKind
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain.kv_groups import KVGroupLayout, KVGroupSpec, group_layers, is_plain

__all__ = ["RunnerKVLayout", "runner_kv_layout"]


@dataclass(frozen=True)
class RunnerKVLayout:
    """The model's KV groups and where this runner's layers live in its cache.

    ``groups`` are the whole model's (what the scheduler keeps a table per); the other
    fields are indexed by the position of a layer among the layers this runner holds (its
    ``attention_layers()``, in layer order)."""

    groups: tuple[KVGroupSpec, ...]
    group_of_layer: tuple[int, ...]
    slot_of_layer: tuple[int, ...]
    layers_per_block: int


def runner_kv_layout(
    kinds: Sequence[LayerAttentionKind], held: range, config: RunnerConfig
) -> RunnerKVLayout | None:
    """The KV groups of a model whose decoder layers attend as ``kinds`` (every layer, in
    order), for a runner holding layers ``held``; ``None`` for one table per sequence."""
    windows = [
        None if kind.window is None or kind.window >= config.max_model_len else kind.window
        for kind in kinds
    ]
    if not windows:
        return None
    groups = group_layers(windows)
    if is_plain(groups):
        return None
    layout = KVGroupLayout.of(groups)
    assert held.step == 1 and 0 <= held.start < held.stop <= len(windows), (held, len(windows))
    group_of_layer = tuple(layout.group_of_layer[layer] for layer in held)
    # A layer's slot: its position among the held layers of its group (the domain layout's
    # slot when every layer is held, since a group lists its layers in layer order).
    slot_of_layer = tuple(
        sum(1 for other in groups[group].layers if other in held and other < layer)
        for layer, group in zip(held, group_of_layer, strict=True)
    )
    return RunnerKVLayout(
        groups=layout.groups,
        group_of_layer=group_of_layer,
        slot_of_layer=slot_of_layer,
        layers_per_block=max(slot_of_layer) + 1,
    )
