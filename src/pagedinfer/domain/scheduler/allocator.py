"""Block admission and growth: the one narrow question the loop asks of the block pool.

As vLLM's KV-cache manager answers its scheduler ("these blocks, or ``None``"), a
:class:`BlockAllocator` gives a sequence the blocks a step writes, or refuses and changes
nothing; it finds a new request's cached prefix, registers full blocks in the prefix cache
once their K/V exist, and frees. Who to preempt when it refuses is the loop's decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedinfer.domain.block_pool import Block, BlockPool, cdiv
from pagedinfer.domain.hashing import extend_chain
from pagedinfer.domain.host_tier import TierEntry
from pagedinfer.domain.scheduler.tier import TierLink
from pagedinfer.domain.sequence import Sequence

__all__ = ["Admission", "BlockAllocator"]


@dataclass(frozen=True, slots=True)
class Admission:
    """A first chunk's allocation: ``num_cached`` tokens found in the prefix cache,
    ``num_tokens`` to compute now (both from the start of the sequence). With a host tier,
    ``num_loading`` tokens after the cached ones are copied in first (then ``num_tokens`` is
    0: the request computes nothing before they land)."""

    num_cached: int
    num_tokens: int
    num_loading: int = 0


class BlockAllocator:
    """Blocks for the sequences of one scheduler, from ``pool``."""

    __slots__ = ("block_size", "pool", "tier")

    def __init__(self, pool: BlockPool, tier: TierLink | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.tier = tier

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_groups(self) -> int:
        """KV groups: tables per sequence, blocks per logical block (one here)."""
        return 1

    @property
    def frees_in_place(self) -> bool:
        """Whether :meth:`register_full_blocks` may free entries of ``seq``'s tables in
        place (a KV group is a sliding window), which copies of them must then follow."""
        return False

    def opens_block(self, seq: Sequence) -> bool:
        """True when ``seq``'s next token is the first of a block it does not hold yet."""
        return seq.num_computed_tokens == len(seq.block_table) * self.block_size

    def growth_capacity(self, seq: Sequence) -> int:
        """How many more tokens ``seq`` can compute with its blocks plus all free blocks."""
        slots = (len(seq.block_table) + self.pool.num_free_blocks) * self.block_size
        return slots - seq.num_computed_tokens

    def blocks_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` lacks to compute its next ``num_tokens`` tokens."""
        needed = cdiv(seq.num_computed_tokens + num_tokens, self.block_size)
        return max(needed - len(seq.block_table), 0)

    def allocate_slots(
        self, seq: Sequence, num_tokens: int, *, reserve: int = 0
    ) -> list[int] | None:
        """Blocks for ``seq``'s next ``num_tokens`` tokens, appended to its table and
        returned (the new ones; ``[]`` if it holds them), or ``None``, changing nothing,
        unless they and ``reserve`` more blocks are free."""
        missing = self.blocks_missing(seq, num_tokens)
        if missing + reserve > self.pool.num_free_blocks:
            return None
        if missing == 0:
            return []
        new = [block.block_id for block in self.pool.allocate(missing)]
        seq.block_table.extend(new)
        return new

    def allocate_lookahead(self, seq: Sequence, num_tokens: int, lookahead: int) -> None:
        """Blocks for ``lookahead`` positions after ``seq``'s next ``num_tokens``, as far as
        free blocks allow (a draft model's K/V is a guess: never worth a preemption)."""
        wanted = cdiv(seq.num_computed_tokens + num_tokens + lookahead, self.block_size)
        missing = min(wanted - len(seq.block_table), self.pool.num_free_blocks)
        if missing > 0:
            seq.block_table.extend(block.block_id for block in self.pool.allocate(missing))

    def admit(self, seq: Sequence, budget: int, *, reserve_if_whole: int = 0) -> Admission | None:
        """Give a waiting ``seq`` its cached prefix and the blocks of its first chunk (at
        most ``budget`` tokens), plus ``reserve_if_whole`` free blocks when that chunk
        reaches its end; ``None``, changing nothing, when they do not fit."""
        pool = self.pool
        size = self.block_size
        hits = []
        # Prompt logprobs need the logits of every prompt token: nothing may come from the
        # cache (as in vLLM).
        use_cache = pool.enable_prefix_caching and seq.params.prompt_logprobs is None
        if use_cache:
            # At least one token must be computed to get logits, so a fully cached prompt
            # still recomputes its last block.
            max_hit_blocks = (seq.num_tokens - 1) // size
            extend_chain(seq.block_hashes, seq.token_ids, size, max_hit_blocks, seq.extra_key)
            hits = pool.find_cached_prefix(seq.block_hashes[:max_hit_blocks], seq.token_ids)
            if self.tier is not None:
                loads = self.tier.find(seq, len(hits), max_hit_blocks)
                if loads:
                    return self._admit_loading(seq, hits, loads)
        num_cached = len(hits) * size
        num_tokens = min(seq.num_tokens - num_cached, budget)
        num_new_blocks = cdiv(num_cached + num_tokens, size) - len(hits)
        reserve = reserve_if_whole if num_cached + num_tokens == seq.num_tokens else 0
        if num_new_blocks + reserve + pool.cost_of_acquiring(hits) > pool.num_free_blocks:
            return None
        pool.acquire(hits)  # before allocating, so allocation cannot evict a hit
        new_blocks = pool.allocate(num_new_blocks)
        seq.block_table = [block.block_id for block in hits]
        seq.block_table.extend(block.block_id for block in new_blocks)
        seq.num_registered_blocks = len(hits)
        if use_cache:
            pool.record_prefix_lookup(seq.num_tokens, num_cached)
            if self.tier is not None:  # looked up there too, found nothing
                self.tier.tier.record_lookup(max(max_hit_blocks - len(hits), 0), 0)
        return Admission(num_cached, num_tokens)

    def _admit_loading(
        self, seq: Sequence, hits: list[Block], loads: list[TierEntry]
    ) -> Admission | None:
        """Admit ``seq`` with its device ``hits`` and fresh blocks for the ``loads`` found in
        the host tier after them; it computes nothing until they are copied in."""
        pool = self.pool
        tier = self.tier
        assert tier is not None
        if len(loads) + pool.cost_of_acquiring(hits) > pool.num_free_blocks:
            return None
        pool.acquire(hits)
        tier.pin(loads)  # before allocating: evictions into the tier must not evict them
        fresh = [block.block_id for block in pool.allocate(len(loads))]
        seq.block_table = [block.block_id for block in hits]
        seq.block_table.extend(fresh)
        seq.num_registered_blocks = len(hits)
        tier.start_load(seq, loads, fresh)
        size = self.block_size
        pool.record_prefix_lookup(seq.num_tokens, len(hits) * size)
        max_hit_blocks = (seq.num_tokens - 1) // size
        tier.tier.record_lookup(max_hit_blocks - len(hits), len(loads))
        return Admission(len(hits) * size, 0, num_loading=len(loads) * size)

    def append_block(self, seq: Sequence) -> int | None:
        """One more block at the end of ``seq``'s table, or ``None`` if none is free."""
        if self.pool.num_free_blocks == 0:
            return None
        block_id = self.pool.allocate(1)[0].block_id
        seq.block_table.append(block_id)
        return block_id

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer ``seq``'s computed full blocks to the prefix cache (its K/V exist now)."""
        pool = self.pool
        if not pool.enable_prefix_caching:
            return
        size = self.block_size
        num_full = min(seq.num_computed_tokens // size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = extend_chain(seq.block_hashes, seq.token_ids, size, num_full, seq.extra_key)
        for index in range(seq.num_registered_blocks, num_full):
            block_id = seq.block_table[index]
            if pool.block(block_id).hash is None:
                parent = hashes[index - 1] if index else None
                tokens = seq.token_ids[index * size : (index + 1) * size]
                pool.register(block_id, hashes[index], parent, tokens)
        seq.num_registered_blocks = num_full

    def fork_blocks(self, parent: Sequence, child: Sequence) -> tuple[tuple[int, int], ...]:
        """Give ``child`` (a fork of ``parent``, whose prompt is computed) the prompt's full
        blocks, shared, and a copy of its partial last block; returns the copies
        ``(source, destination)`` to make, each source pinned with one reference until
        then. The blocks must be free (:attr:`num_groups` per partial block)."""
        pool = self.pool
        num_full = parent.num_tokens // self.block_size
        shared = parent.block_table[:num_full]
        pool.share(shared)
        child.block_table = list(shared)
        if parent.num_tokens % self.block_size == 0:
            return ()
        partial = parent.block_table[num_full]
        copy = pool.allocate(1)[0].block_id
        pool.share([partial])  # pinned until the copy ran
        child.block_table.append(copy)
        return ((partial, copy),)

    def trim(self, seq: Sequence, keep: int) -> None:
        """Free ``seq``'s blocks past its first ``keep`` (given for a step that never ran:
        never registered, never shared)."""
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[keep:][::-1])
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release every block ``seq`` holds (newest first: evicted last); a load from the
        host tier that has not landed is cancelled."""
        if self.tier is not None:
            self.tier.release(seq)
        self.pool.free(seq.block_table[::-1])
        seq.block_table = []
        seq.num_registered_blocks = 0
