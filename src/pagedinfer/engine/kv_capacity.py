"""The KV cache's capacity as the engine logs it at start-up (INFO, logger
``pagedinfer.engine.kv_capacity``).

One line for the pool: its blocks and tokens, and how many ``max_model_len`` sequences it holds
at once. With KV groups (hybrid attention, ``docs/kv-groups.md``) one more line per group: its
layers, its window, and the most blocks one sequence holds in it: a full group's whole
context (up to ``max_model_len`` tokens), a sliding group's window
(:func:`~pagedinfer.domain.sliding_window.max_live_blocks` between steps, the blocks before the
window freed), so a user sees the sliding layers bounded by their window. The same numbers,
live, are in ``Engine.stats().kv_groups``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pagedinfer.domain.kv_groups import KVGroupSpec
from pagedinfer.domain.scheduler import SchedulerConfig
from pagedinfer.domain.sliding_window import max_live_blocks

__all__ = ["group_blocks_per_sequence", "kv_capacity_lines", "log_kv_capacity"]

_logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _layer_ranges(layers: Sequence[int]) -> str:
    """``0, 1, 2, 4`` -> ``"0-2, 4"``."""
    ranges: list[str] = []
    start = previous = layers[0]
    for layer in (*layers[1:], None):
        if layer is not None and layer == previous + 1:
            previous = layer
            continue
        ranges.append(str(start) if start == previous else f"{start}-{previous}")
        if layer is not None:
            start = previous = layer
    return ", ".join(ranges)


def group_blocks_per_sequence(group: KVGroupSpec, block_size: int, max_model_len: int) -> int:
    """The most blocks one sequence holds in ``group`` between steps."""
    context = _cdiv(max_model_len, block_size)
    if group.window is None:
        return context
    return min(context, max_live_blocks(group.window, block_size))


def kv_capacity_lines(config: SchedulerConfig) -> list[str]:
    """What :func:`log_kv_capacity` logs for a scheduler of ``config`` (see the module doc)."""
    block_size, max_model_len = config.block_size, config.max_model_len
    pool = (
        f"KV cache: {config.num_blocks} blocks of {block_size} tokens "
        f"({config.num_blocks * block_size} token slots)"
    )
    if config.is_plain:
        per_sequence = _cdiv(max_model_len, block_size)
        return [
            f"{pool}; a sequence of max_model_len={max_model_len} tokens holds {per_sequence} "
            f"blocks: {config.num_blocks // per_sequence} such sequences fit at once"
        ]
    groups = config.kv_groups
    per_group = [group_blocks_per_sequence(g, block_size, max_model_len) for g in groups]
    per_sequence = sum(per_group)
    usable = config.num_blocks - 1  # the null block
    lines = [
        f"{pool} shared by {len(groups)} KV group(s) (one block is the null block); a "
        f"sequence of max_model_len={max_model_len} tokens holds at most {per_sequence} "
        f"blocks across them between steps: {usable // per_sequence} such sequences fit at once"
    ]
    for index, (group, blocks) in enumerate(zip(groups, per_group, strict=True)):
        layers = f"{len(group.layers)} layer(s) [{_layer_ranges(group.layers)}]"
        if group.window is None:
            lines.append(
                f"KV group {index}: full attention, {layers}: up to {blocks} blocks per "
                f"sequence (its whole context, up to {max_model_len} tokens)"
            )
        else:
            covered = min(group.window, max_model_len)
            lines.append(
                f"KV group {index}: sliding window {group.window}, {layers}: at most {blocks} "
                f"blocks per sequence between steps (the last {covered} tokens of context; "
                "blocks before the window are freed)"
            )
    return lines


def log_kv_capacity(config: SchedulerConfig) -> None:
    """Log the KV cache's capacity, per KV group (INFO)."""
    for line in kv_capacity_lines(config):
        _logger.info("%s", line)
