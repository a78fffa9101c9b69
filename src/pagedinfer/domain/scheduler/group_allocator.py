"""Blocks for hybrid attention: one table per KV group, sliding groups bounded by their window.

:class:`GroupedBlockAllocator` answers the loop's questions as :class:`BlockAllocator` does,
for every group at once (:mod:`pagedinfer.domain.kv_groups`): all of a sequence's tables have
the same length (logical block ``i`` exists in every group or in none), so a step that needs
``m`` more blocks needs ``m`` in each group, from the one shared pool. ``seq.block_table`` is
group 0's table, ``seq.group_block_tables`` the others'.

A sliding group drops the blocks its window no longer sees when a step is *recorded*
(:meth:`register_full_blocks`, called with the sequence's computed count final): a count that
is recorded never goes back (a plan that never ran rolls back to it, at most), so a freed
block is never needed again. Between steps a sliding group therefore holds at most
``ceil(window / block_size) + 1`` blocks per sequence
(:func:`~pagedinfer.domain.sliding_window.max_live_blocks`); its other entries are the null
block. Freed blocks keep their hashes, so the prefix cache can still serve them.

Prefix caching: a full group hits on its chain from the start, a sliding group where the
blocks of the last window before the hit point are cached (vLLM's rule); the hit is the
longest length every group accepts. Each group keys its blocks apart
(:func:`~pagedinfer.domain.kv_groups.group_block_key`).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from functools import partial

from pagedinfer.domain.block_pool import Block, BlockPool, cdiv
from pagedinfer.domain.hashing import extend_chain
from pagedinfer.domain.kv_groups import KVGroupSpec, group_block_key
from pagedinfer.domain.scheduler.allocator import Admission, BlockAllocator
from pagedinfer.domain.sequence import Sequence
from pagedinfer.domain.sliding_window import (
    first_visible_block,
    longest_window_hit,
    max_live_blocks,
)

__all__ = ["GroupedBlockAllocator", "KVGroupUsage"]


@dataclass(frozen=True, slots=True)
class KVGroupUsage:
    """One KV group's share of the pool now: its window (``None``: full attention), its
    layers, the blocks its tables hold, and the most one sequence holds between steps
    (sliding groups; ``None``: the whole context)."""

    window: int | None
    num_layers: int
    num_blocks_held: int
    max_blocks_per_sequence: int | None


class GroupedBlockAllocator(BlockAllocator):
    """Blocks for the sequences of one scheduler, one table per KV group, from ``pool``.

    It holds the null block (the pool's first free block, id 0 in a fresh pool) for life.
    """

    __slots__ = ("_num_groups", "_sliding", "groups", "null_block")

    def __init__(self, pool: BlockPool, groups: SequenceABC[KVGroupSpec]) -> None:
        super().__init__(pool)
        self.groups = tuple(groups)
        self._num_groups = len(self.groups)
        # (group index, window) of each sliding group.
        self._sliding = tuple(
            (index, group.window) for index, group in enumerate(self.groups) if group.window
        )
        self.null_block = pool.allocate(1)[0].block_id  # never written, never freed

    @property
    def num_groups(self) -> int:
        return self._num_groups

    @property
    def frees_in_place(self) -> bool:
        return bool(self._sliding)

    def tables(self, seq: Sequence) -> list[list[int]]:
        """``seq``'s table in each group, group 0 first."""
        return [seq.block_table, *seq.group_block_tables]

    def live_blocks(self, seq: Sequence, group: int) -> list[int]:
        """The blocks ``seq`` holds in ``group`` (its table less the null entries)."""
        null = self.null_block
        return [block for block in self.tables(seq)[group] if block != null]

    def usage(self, seqs: SequenceABC[Sequence]) -> tuple[KVGroupUsage, ...]:
        """Each group's blocks held by ``seqs`` (a block shared by forks counted once). O(the
        blocks held): for statistics."""
        null = self.null_block
        held: list[set[int]] = [set() for _ in self.groups]
        for seq in seqs:
            for blocks, table in zip(held, self.tables(seq), strict=False):
                blocks.update(table)
        return tuple(
            KVGroupUsage(
                window=group.window,
                num_layers=len(group.layers),
                num_blocks_held=len(blocks - {null}),
                max_blocks_per_sequence=(
                    None if group.window is None else max_live_blocks(group.window, self.block_size)
                ),
            )
            for group, blocks in zip(self.groups, held, strict=True)
        )

    # -------------------------------------------------------------- growth
    def growth_capacity(self, seq: Sequence) -> int:
        slots = (len(seq.block_table) + self.pool.num_free_blocks // self._num_groups) * (
            self.block_size
        )
        return slots - seq.num_computed_tokens

    def blocks_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` lacks, in all groups together, to compute ``num_tokens`` more."""
        return super().blocks_missing(seq, num_tokens) * self._num_groups

    def allocate_slots(
        self, seq: Sequence, num_tokens: int, *, reserve: int = 0
    ) -> list[int] | None:
        """As :meth:`BlockAllocator.allocate_slots`, in every group; returns group 0's new
        blocks."""
        missing = super().blocks_missing(seq, num_tokens)
        if missing * self._num_groups + reserve > self.pool.num_free_blocks:
            return None
        if missing == 0:
            return []
        for table in self.tables(seq):
            table.extend(block.block_id for block in self.pool.allocate(missing))
        return seq.block_table[-missing:]

    def allocate_lookahead(self, seq: Sequence, num_tokens: int, lookahead: int) -> None:
        wanted = cdiv(seq.num_computed_tokens + num_tokens + lookahead, self.block_size)
        missing = min(wanted - len(seq.block_table), self.pool.num_free_blocks // self._num_groups)
        if missing > 0:
            for table in self.tables(seq):
                table.extend(block.block_id for block in self.pool.allocate(missing))

    def append_block(self, seq: Sequence) -> int | None:
        if self.pool.num_free_blocks < self._num_groups:
            return None
        for table in self.tables(seq):
            table.append(self.pool.allocate(1)[0].block_id)
        return seq.block_table[-1]

    # ------------------------------------------------------------ admission
    def admit(self, seq: Sequence, budget: int, *, reserve_if_whole: int = 0) -> Admission | None:
        pool = self.pool
        size = self.block_size
        use_cache = pool.enable_prefix_caching and seq.params.prompt_logprobs is None
        num_hit_blocks = 0
        matches: list[dict[int, Block]] = [{} for _ in self.groups]
        if use_cache:
            max_hit_blocks = (seq.num_tokens - 1) // size
            extend_chain(seq.block_hashes, seq.token_ids, size, max_hit_blocks, seq.extra_key)
            num_hit_blocks = self._hit_length(seq, max_hit_blocks, matches)
        num_cached = num_hit_blocks * size
        num_tokens = min(seq.num_tokens - num_cached, budget)
        num_new = cdiv(num_cached + num_tokens, size) - num_hit_blocks
        hits: list[list[Block]] = []
        firsts: list[int] = []
        for index, group in enumerate(self.groups):
            first = 0
            if group.window is not None:
                first = first_visible_block(num_cached, group.window, size)
            firsts.append(first)
            hits.append([matches[index][block] for block in range(first, num_hit_blocks)])
        cost = sum(pool.cost_of_acquiring(group_hits) for group_hits in hits)
        reserve = reserve_if_whole if num_cached + num_tokens == seq.num_tokens else 0
        if num_new * self._num_groups + reserve + cost > pool.num_free_blocks:
            return None
        for group_hits in hits:
            pool.acquire(group_hits)  # before allocating, so allocation cannot evict a hit
        tables = []
        for first, group_hits in zip(firsts, hits, strict=True):
            table = [self.null_block] * first
            table.extend(block.block_id for block in group_hits)
            table.extend(block.block_id for block in pool.allocate(num_new))
            tables.append(table)
        seq.block_table = tables[0]
        seq.group_block_tables = tables[1:]
        seq.num_registered_blocks = num_hit_blocks
        if use_cache:
            pool.record_prefix_lookup(seq.num_tokens, num_cached)
        return Admission(num_cached, num_tokens)

    def _hit_length(self, seq: Sequence, max_blocks: int, matches: list[dict[int, Block]]) -> int:
        """The longest prefix (in blocks, at most ``max_blocks``) every group can serve;
        ``matches[g]`` gets the cached blocks found in group ``g`` by index."""
        pool = self.pool
        hashes = seq.block_hashes
        tokens = seq.token_ids
        size = self.block_size
        length = max_blocks
        for index, group in enumerate(self.groups):
            if group.window is None and length:
                keys = [group_block_key(digest, index) for digest in hashes[:length]]
                found = pool.find_cached_prefix(keys, tokens)
                matches[index].update(enumerate(found))
                length = len(found)

        def lookup(group: int, block: int) -> bool:
            found = matches[group]
            if block in found:
                return True
            parent = group_block_key(hashes[block - 1], group) if block else None
            key = group_block_key(hashes[block], group)
            match = pool.find_cached_block(key, parent, tokens[block * size : (block + 1) * size])
            if match is None:
                return False
            found[block] = match
            return True

        changed = True
        while changed and length:  # a shorter hit in one group may fail another's window
            changed = False
            for index, window in self._sliding:
                best = longest_window_hit(partial(lookup, index), length, window, size)
                if best < length:
                    length = best
                    changed = True
        return length

    # ------------------------------------------------------ record and free
    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer ``seq``'s computed full blocks to the prefix cache in every group, then
        free what its sliding groups no longer see."""
        pool = self.pool
        if pool.enable_prefix_caching:
            size = self.block_size
            num_full = min(seq.num_computed_tokens // size, len(seq.block_table))
            done = seq.num_registered_blocks
            if num_full > done:
                hashes = extend_chain(
                    seq.block_hashes, seq.token_ids, size, num_full, seq.extra_key
                )
                null = self.null_block
                tables = self.tables(seq)
                for index in range(done, num_full):
                    # One tuple for every group (the pool keeps a tuple as it is).
                    tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
                    for group, table in enumerate(tables):
                        block_id = table[index]
                        if block_id == null or pool.block(block_id).hash is not None:
                            continue
                        parent = group_block_key(hashes[index - 1], group) if index else None
                        pool.register(
                            block_id, group_block_key(hashes[index], group), parent, tokens
                        )
                seq.num_registered_blocks = num_full
        self._free_out_of_window(seq)

    def _free_out_of_window(self, seq: Sequence) -> None:
        """Free the sliding groups' blocks before what ``seq``'s next query can see."""
        computed = seq.num_computed_tokens
        null = self.null_block
        tables = self.tables(seq)
        for group, window in self._sliding:
            table = tables[group]
            index = min(first_visible_block(computed, window, self.block_size), len(table)) - 1
            freed = []
            while index >= 0 and table[index] != null:  # the null entries are a prefix
                freed.append(table[index])
                table[index] = null
                index -= 1
            if freed:
                self.pool.free(freed)

    def fork_blocks(self, parent: Sequence, child: Sequence) -> tuple[tuple[int, int], ...]:
        pool = self.pool
        null = self.null_block
        num_full = parent.num_tokens // self.block_size
        partial = parent.num_tokens % self.block_size != 0
        copies = []
        tables = []
        for table in self.tables(parent):
            shared = table[:num_full]
            pool.share([block for block in shared if block != null])
            child_table = list(shared)
            if partial:
                source = table[num_full]
                copy = pool.allocate(1)[0].block_id
                pool.share([source])  # pinned until the copy ran
                copies.append((source, copy))
                child_table.append(copy)
            tables.append(child_table)
        child.block_table = tables[0]
        child.group_block_tables = tables[1:]
        return tuple(copies)

    def trim(self, seq: Sequence, keep: int) -> None:
        null = self.null_block
        for table in self.tables(seq):
            if len(table) > keep:
                self.pool.free([block for block in table[keep:][::-1] if block != null])
                del table[keep:]

    def free(self, seq: Sequence) -> None:
        null = self.null_block
        for table in self.tables(seq):
            self.pool.free([block for block in table[::-1] if block != null])
        seq.block_table = []
        seq.group_block_tables = []
        seq.num_registered_blocks = 0
