"""KV-cache groups: the model's attention layers grouped by what they can see.

A model may mix attention kinds: full attention (every layer sees the whole context) and
sliding-window attention (a layer with window ``w`` lets the query at position ``p`` see the
keys at positions ``p - w + 1 .. p``, transformers' ``sliding_window``). Layers of one kind
share a block table per sequence; a sliding group's table keeps only the blocks its window
can still see (:mod:`pagedinfer.domain.sliding_window`), so the KV memory of those layers is
bounded by the window instead of the context.

**Layout (as vLLM's hybrid KV-cache manager).** All groups draw their blocks from *one*
:class:`~pagedinfer.domain.block_pool.BlockPool`, and every group holds the same number of
layers (:attr:`KVGroupLayout.layers_per_group`; the last group of a kind may have fewer, the
rest of its page is unused). The KV cache is then one tensor per *position in a group*
(``[2, layers_per_group, num_blocks, block_size, heads, head_dim]``): layer ``l`` reads and
writes ``cache[:, slot_of_layer[l]]`` at the block ids of its group's table. A block id
belongs to one group's table at a time, so layers of different groups never share a page.
One pool, rather than a pool per group, lets memory flow to whichever group needs it (a
long context fills the full groups; many short ones the sliding groups) with no split to
tune, and a block costs the same in every group.

**The null block.** A sliding group's entries for blocks out of its window point to the
*null block*, one block the manager holds for its whole life and never writes (the first
block of the pool, id 0, which is also the plan's ``BLOCK_TABLE_FILLER``). Kernels must not
read it unmasked: they skip (or mask, by position) keys before ``p - w + 1``.

With every layer in one full-attention group (every model without a window) there is one
table per sequence, no null block, and nothing differs from a plain pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from pagedinfer.domain.block_pool import cdiv
from pagedinfer.errors import ConfigurationError

__all__ = [
    "KVGroupLayout",
    "KVGroupSpec",
    "blocks_for_one_sequence",
    "group_block_key",
    "group_layers",
    "min_blocks_for_one_sequence",
]


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """One group: its attention window (``None``: full attention) and its layers' indices."""

    window: int | None
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.window is not None and (
            not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1
        ):
            raise ConfigurationError(
                f"a sliding window of {self.window!r} is invalid: expected an integer >= 1 "
                "(None for full attention)."
            )
        if not self.layers:
            raise ConfigurationError("a KV group needs at least one layer.")

    @property
    def is_sliding(self) -> bool:
        return self.window is not None


def group_layers(windows: Sequence[int | None]) -> tuple[KVGroupSpec, ...]:
    """Groups for a model whose layer ``l`` has window ``windows[l]`` (``None``: full).

    One kind: one group of every layer. Several kinds: each kind's layers, in layer order,
    split into groups of the smallest kind's layer count (vLLM's rule: equal pages, little
    padding); full-attention groups come first, then sliding ones by window. Group 0 is
    therefore a full group whenever the model has one.
    """
    if not windows:
        raise ConfigurationError("a model needs at least one attention layer for KV groups.")
    by_kind: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_kind.setdefault(window, []).append(layer)
    kinds = sorted(by_kind, key=lambda w: (w is not None, w or 0))
    size = min(len(layers) for layers in by_kind.values())
    groups: list[KVGroupSpec] = []
    for window in kinds:
        layers = by_kind[window]
        step = len(layers) if len(by_kind) == 1 else size
        for start in range(0, len(layers), step):
            groups.append(KVGroupSpec(window, tuple(layers[start : start + step])))
    return tuple(groups)


@dataclass(frozen=True, slots=True)
class KVGroupLayout:
    """Where each layer's K/V live: its group and its slot (position in the group)."""

    groups: tuple[KVGroupSpec, ...]
    group_of_layer: tuple[int, ...]
    slot_of_layer: tuple[int, ...]
    layers_per_group: int

    @classmethod
    def of(cls, groups: Sequence[KVGroupSpec]) -> KVGroupLayout:
        """The layout of ``groups``, which must cover layers ``0 .. n - 1`` once each."""
        found: dict[int, tuple[int, int]] = {}
        for index, group in enumerate(groups):
            for slot, layer in enumerate(group.layers):
                if layer in found or layer < 0:
                    raise ConfigurationError(f"layer {layer} is in two KV groups (or negative).")
                found[layer] = (index, slot)
        if sorted(found) != list(range(len(found))):
            raise ConfigurationError(
                f"the KV groups cover layers {sorted(found)}: expected 0 .. {len(found) - 1}."
            )
        return cls(
            groups=tuple(groups),
            group_of_layer=tuple(found[layer][0] for layer in range(len(found))),
            slot_of_layer=tuple(found[layer][1] for layer in range(len(found))),
            layers_per_group=max(len(group.layers) for group in groups),
        )

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's window, in layer order."""
        return tuple(self.groups[group].window for group in self.group_of_layer)


def is_plain(groups: Sequence[KVGroupSpec]) -> bool:
    """True for no groups or one full-attention group: a plain pool, one table per sequence."""
    return len(groups) <= 1 and all(group.window is None for group in groups)


def group_block_key(digest: int, group: int) -> int:
    """The prefix-cache key of a block of ``group`` whose chained hash is ``digest``.

    Group 0 uses the chained hash itself (so a model with one group keys its cache exactly as
    before, :mod:`pagedinfer.domain.hashing`); another group's blocks hold other layers' K/V
    of the same tokens, so their key is the hash rehashed with the group as seed.
    """
    if group == 0:
        return digest
    return xxhash.xxh64_intdigest(digest.to_bytes(8, "little"), seed=group)


def min_blocks_for_one_sequence(
    groups: Sequence[KVGroupSpec],
    block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> int:
    """The smallest pool in which one ``max_model_len`` sequence always makes progress alone.

    A full group needs a block per ``block_size`` tokens of context; a sliding group the
    blocks its window sees plus those of the chunks a step (and a step planned ahead of it)
    writes, never more than the whole context's; plus the null block.
    """
    return blocks_for_one_sequence(groups, block_size, max_model_len, max_num_batched_tokens)


def blocks_for_one_sequence(
    groups: Sequence[KVGroupSpec],
    block_size: int,
    num_tokens: int,
    max_num_batched_tokens: int,
    *,
    copies: int = 0,
) -> int:
    """The most blocks a sequence of ``num_tokens`` tokens holds at once across ``groups``
    (see :func:`min_blocks_for_one_sequence`), plus ``copies`` blocks in every group (the
    copies of its last partial block that the other completions of an ``n > 1`` request
    take)."""
    context = cdiv(num_tokens, block_size)
    if is_plain(groups):
        return context + copies
    total = 1  # the null block
    chunk = cdiv(min(max_num_batched_tokens, num_tokens), block_size)
    for group in groups:
        if group.window is None:
            total += context + copies
        else:
            total += min(context, cdiv(group.window - 1, block_size) + 1 + 2 * chunk) + copies
    return total
