"""The physical KV blocks: allocation, reference counts and the prefix-cache index.

Every operation costs O(1) per block it touches, whatever the pool size:

* free blocks without a hash sit in a FIFO (``deque``); they are handed out first;
* free blocks that still carry a hash sit in an ``OrderedDict`` in the order they were freed,
  so a cache hit can pull one out in O(1) (nano-vLLM's ``deque.remove`` is O(pool)) and
  eviction takes the least recently freed one;
* the index maps a hash to *all* blocks that carry it (``dict[hash, dict[block_id, Block]]``),
  so two physical copies of the same content never clobber each other's entry.

The pool checks every request before it mutates anything: a failed call leaves ref counts,
free lists and the index exactly as they were.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagedinfer.errors import BlockPoolError

__all__ = ["Block", "BlockPool", "EvictedBlock", "PoolStats", "cdiv"]

# A block that left the prefix cache: (block id, hash, parent hash, token ids). Its K/V are
# still in the physical block until the step that reuses it writes there.
EvictedBlock = tuple[int, int, int | None, tuple[int, ...]]


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-numerator // denominator)


class Block:
    """One physical block: ``block_size`` token slots in every layer's K and V cache."""

    __slots__ = ("block_id", "hash", "parent_hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        # Set once the block is full and its K/V are computed; kept after it is freed so the
        # prefix cache can find it, cleared when the block is reused for other content.
        self.hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_count}, hash={self.hash})"


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int  # blocks that carry a hash (in use or free)
    prefix_query_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # of those, tokens served from the cache

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        if not self.prefix_query_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens


class BlockPool:
    """A fixed set of KV blocks with ref counting and a chained-hash prefix cache."""

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1:
            raise BlockPoolError(f"num_blocks={num_blocks} is invalid: a pool needs >= 1 block.")
        if block_size < 1:
            raise BlockPoolError(f"block_size={block_size} is invalid: it must be >= 1.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [Block(block_id) for block_id in range(num_blocks)]
        self._free_uncached: deque[Block] = deque(self._blocks)
        self._free_cached: OrderedDict[int, Block] = OrderedDict()
        self._index: dict[int, dict[int, Block]] = {}
        self._num_indexed = 0  # blocks in the index, all copies counted: stats() stays O(1)
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._evicted: list[EvictedBlock] | None = None  # kept only for a host tier

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block(self, block_id: int) -> Block:
        if not 0 <= block_id < self.num_blocks:
            raise BlockPoolError(
                f"block id {block_id} is unknown: ids run from 0 to {self.num_blocks - 1}."
            )
        return self._blocks[block_id]

    def find_cached_prefix(
        self, block_hashes: Sequence[int], token_ids: Sequence[int]
    ) -> list[Block]:
        """The longest run of cached blocks matching ``block_hashes`` from the first one.

        ``block_hashes[i]`` is the chained hash of block ``i`` of ``token_ids``. A candidate
        counts only if its stored tokens and parent hash match too (hash-collision guard); the
        search stops at the first miss because a chain only matches from its start. Among
        duplicate copies, a block already in use is preferred: sharing it costs no free block.
        Nothing is mutated; call :meth:`acquire` to take the blocks.
        """
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        found: list[Block] = []
        parent: int | None = None
        for index, digest in enumerate(block_hashes):
            start = index * size
            match = self.find_cached_block(digest, parent, token_ids[start : start + size])
            if match is None:
                break
            found.append(match)
            parent = digest
        return found

    def find_cached_block(
        self, digest: int, parent_hash: int | None, token_ids: Sequence[int]
    ) -> Block | None:
        """The cached block registered under ``digest`` with this parent hash and these
        tokens (a copy in use preferred), or ``None``. Nothing is mutated."""
        candidates = self._index.get(digest)
        if not candidates or not self.enable_prefix_caching:
            return None
        expected = tuple(token_ids)
        match: Block | None = None
        for candidate in candidates.values():
            if candidate.token_ids == expected and candidate.parent_hash == parent_hash:
                match = candidate
                if candidate.ref_count > 0:
                    break
        return match

    def cost_of_acquiring(self, blocks: Iterable[Block]) -> int:
        """Free blocks that :meth:`acquire` would consume (cached blocks that are now free)."""
        return sum(1 for block in blocks if block.ref_count == 0)

    # --------------------------------------------------------------- mutations
    def acquire(self, blocks: Sequence[Block]) -> None:
        """Take a reference on cached blocks returned by :meth:`find_cached_prefix`."""
        for block in blocks:
            if self._blocks[block.block_id] is not block or block.hash is None:
                raise BlockPoolError(f"{block!r} is not a cached block of this pool.")
        for block in blocks:
            if block.ref_count == 0:
                del self._free_cached[block.block_id]
            block.ref_count += 1

    def share(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on blocks in use (another sequence reads them too: the
        completions of one prompt, ``n > 1``). Raises before changing anything if one is free."""
        for block_id in block_ids:
            if self.block(block_id).ref_count == 0:
                raise BlockPoolError(f"block {block_id} is free: only blocks in use are shared.")
        for block_id in block_ids:
            self._blocks[block_id].ref_count += 1

    def allocate(self, num_blocks: int) -> list[Block]:
        """Hand out ``num_blocks`` free blocks, each with ``ref_count == 1``.

        Blocks without a hash go first; then cached blocks in least-recently-freed order,
        whose index entries are dropped (the block is evicted from the prefix cache).
        """
        if num_blocks < 0:
            raise BlockPoolError(f"cannot allocate {num_blocks} blocks.")
        if num_blocks > self.num_free_blocks:
            raise BlockPoolError(
                f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} of "
                f"{self.num_blocks} are free."
            )
        allocated: list[Block] = []
        for _ in range(num_blocks):
            if self._free_uncached:
                block = self._free_uncached.popleft()
            else:
                _, block = self._free_cached.popitem(last=False)
                self._evict(block)
            block.ref_count = 1
            allocated.append(block)
        return allocated

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per id, in the given order.

        Pass a sequence's block table reversed so that its tail blocks are freed (and later
        evicted) first and the head of its chain, the part others share, survives longest.
        """
        pending: dict[int, int] = {}
        for block_id in block_ids:
            block = self.block(block_id)
            pending[block_id] = pending.get(block_id, 0) + 1
            if pending[block_id] > block.ref_count:
                raise BlockPoolError(
                    f"double free of block {block_id}: its ref_count is {block.ref_count}."
                )
        for block_id in block_ids:
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free_uncached.append(block)
                else:
                    self._free_cached[block_id] = block

    def register(
        self, block_id: int, digest: int, parent_hash: int | None, token_ids: Sequence[int]
    ) -> None:
        """Make a full, computed, in-use block findable under its chained hash."""
        if not self.enable_prefix_caching:
            return
        block = self.block(block_id)
        if block.ref_count == 0:
            raise BlockPoolError(f"cannot register free block {block_id}.")
        if block.hash is not None:
            raise BlockPoolError(f"block {block_id} is already registered (hash {block.hash}).")
        if len(token_ids) != self.block_size:
            raise BlockPoolError(
                f"only full blocks are cached: block {block_id} has {len(token_ids)} tokens, "
                f"block_size is {self.block_size}."
            )
        block.hash = digest
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        self._index.setdefault(digest, {})[block_id] = block
        self._num_indexed += 1

    def record_evictions(self) -> None:
        """From now on, keep the blocks evicted from the prefix cache for
        :meth:`drain_evictions` (a host tier copies them out before they are overwritten)."""
        if self._evicted is None:
            self._evicted = []

    def drain_evictions(self) -> list[EvictedBlock]:
        """The blocks evicted since the last call, oldest first (empty unless recorded)."""
        evicted = self._evicted
        if not evicted:
            return []
        self._evicted = []
        return evicted

    def record_prefix_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self._prefix_query_tokens += query_tokens
        self._prefix_hit_tokens += hit_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached block. Blocks in use stay allocated, just no longer findable."""
        self._index.clear()
        self._num_indexed = 0
        for block in self._blocks:
            block.hash = None
            block.parent_hash = None
            block.token_ids = ()
        self._free_uncached.extend(self._free_cached.values())
        self._free_cached.clear()

    def stats(self) -> PoolStats:
        return PoolStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_used_blocks=self.num_used_blocks,
            num_cached_blocks=self._num_indexed,
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
        )

    def check_integrity(self) -> None:
        """Raise :class:`BlockPoolError` if an internal invariant is broken (O(pool); for tests)."""
        free_ids = [block.block_id for block in self._free_uncached]
        free_ids.extend(self._free_cached)
        if len(set(free_ids)) != len(free_ids):
            raise BlockPoolError("a block is on the free lists twice")
        free = set(free_ids)
        for block in self._blocks:
            if (block.ref_count == 0) != (block.block_id in free):
                raise BlockPoolError(f"{block!r}: free-list membership disagrees with ref_count")
            if block.ref_count < 0:
                raise BlockPoolError(f"{block!r}: negative ref_count")
        for block in self._free_uncached:
            if block.hash is not None:
                raise BlockPoolError(f"{block!r} carries a hash but is on the uncached free list")
        for block in self._free_cached.values():
            if block.hash is None:
                raise BlockPoolError(f"{block!r} has no hash but is on the cached free list")
        indexed = 0
        for digest, copies in self._index.items():
            if not copies:
                raise BlockPoolError(f"empty index entry for hash {digest}")
            for block_id, block in copies.items():
                indexed += 1
                if block is not self._blocks[block_id] or block.hash != digest:
                    raise BlockPoolError(f"index entry {digest} -> {block!r} is stale")
        if indexed != self._num_indexed:
            raise BlockPoolError(
                f"{indexed} blocks are indexed but the count says {self._num_indexed}"
            )
        carrying = sum(1 for block in self._blocks if block.hash is not None)
        if carrying != indexed:
            raise BlockPoolError(f"{carrying} blocks carry a hash but {indexed} are indexed")

    # ---------------------------------------------------------------- private
    def _evict(self, block: Block) -> None:
        assert block.hash is not None  # only cached blocks are on the cached free list
        copies = self._index[block.hash]
        del copies[block.block_id]
        self._num_indexed -= 1
        if not copies:
            del self._index[block.hash]
        if self._evicted is not None:
            self._evicted.append((block.block_id, block.hash, block.parent_hash, block.token_ids))
        block.hash = None
        block.parent_hash = None
        block.token_ids = ()
