"""BlockPool: exact ids, ref counts, eviction order, failure atomicity and the prefix index."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest

from pagedinfer.domain import BlockPool, block_hash, chain_hashes
from pagedinfer.domain.block_pool import Block
from pagedinfer.errors import BlockPoolError

BS = 4


def ids(blocks: Sequence[Block]) -> list[int]:
    return [block.block_id for block in blocks]


def refs(pool: BlockPool) -> list[int]:
    return [pool.block(i).ref_count for i in range(pool.num_blocks)]


def snapshot(pool: BlockPool) -> tuple[object, ...]:
    """Everything observable about a pool, to check that a failed call changed nothing."""
    blocks = [pool.block(i) for i in range(pool.num_blocks)]
    # The order in which future allocations would hand out (and evict) the free blocks,
    # observed on a copy so the pool itself is untouched.
    reuse_order = ids(copy.deepcopy(pool).allocate(pool.num_free_blocks))
    return (
        [(b.ref_count, b.hash, b.parent_hash, b.token_ids) for b in blocks],
        pool.stats(),
        reuse_order,
    )


def register_chain(pool: BlockPool, block_ids: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """Register ``block_ids`` as the full blocks of ``tokens``; return their chain hashes."""
    hashes = chain_hashes(tokens, pool.block_size)
    for index, block_id in enumerate(block_ids):
        parent = hashes[index - 1] if index else None
        chunk = tokens[index * pool.block_size : (index + 1) * pool.block_size]
        pool.register(block_id, hashes[index], parent, chunk)
    return hashes


def lookup(pool: BlockPool, tokens: Sequence[int]) -> list[int]:
    return ids(pool.find_cached_prefix(chain_hashes(tokens, pool.block_size), tokens))


TOKENS_A = list(range(100, 116))  # four full blocks
TOKENS_B = list(range(200, 216))


# ------------------------------------------------------------------------ construction
@pytest.mark.parametrize(
    ("num_blocks", "block_size", "message"),
    [
        (0, 4, r"num_blocks=0 is invalid: a pool needs >= 1 block"),
        (-1, 4, r"num_blocks=-1 is invalid"),
        (4, 0, r"block_size=0 is invalid: it must be >= 1"),
        (4, -2, r"block_size=-2 is invalid"),
    ],
)
def test_bad_sizes_are_refused(num_blocks: int, block_size: int, message: str) -> None:
    with pytest.raises(BlockPoolError, match=message):
        BlockPool(num_blocks, block_size)


def test_a_new_pool_is_all_free() -> None:
    pool = BlockPool(5, BS)
    assert pool.num_free_blocks == 5
    assert pool.num_used_blocks == 0
    assert pool.usage == 0.0
    assert refs(pool) == [0] * 5
    pool.check_integrity()


# -------------------------------------------------------------------------- allocation
def test_allocation_hands_out_ids_in_order_with_ref_one() -> None:
    pool = BlockPool(6, BS)
    assert ids(pool.allocate(2)) == [0, 1]
    assert ids(pool.allocate(3)) == [2, 3, 4]
    assert refs(pool) == [1, 1, 1, 1, 1, 0]
    assert pool.num_free_blocks == 1
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_freed_uncached_blocks_are_reused_in_free_order() -> None:
    pool = BlockPool(4, BS)
    pool.allocate(3)  # 0, 1, 2
    pool.free([2, 0])
    # Free FIFO: 3 (never used), then 2, then 0.
    assert ids(pool.allocate(3)) == [3, 2, 0]


def test_failed_allocation_changes_nothing() -> None:
    pool = BlockPool(4, BS)
    blocks = pool.allocate(2)
    register_chain(pool, ids(blocks), TOKENS_A[:8])
    pool.free(ids(blocks)[::-1])  # both cached, free
    pool.allocate(1)  # takes an uncached one (2)
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match="only 3 of 4 are free"):
        pool.allocate(4)
    assert snapshot(pool) == before
    assert lookup(pool, TOKENS_A[:8]) == [0, 1]  # nothing was evicted on the way
    with pytest.raises(BlockPoolError, match="cannot allocate -1 blocks"):
        pool.allocate(-1)
    assert snapshot(pool) == before
    pool.check_integrity()


# ---------------------------------------------------------------------------- freeing
def test_free_drops_one_reference_per_id() -> None:
    pool = BlockPool(3, BS)
    (block,) = pool.allocate(1)
    register_chain(pool, [block.block_id], TOKENS_A[:4])
    pool.acquire([block])
    assert block.ref_count == 2
    pool.free([0])
    assert block.ref_count == 1
    assert pool.num_free_blocks == 2
    pool.free([0])
    assert block.ref_count == 0
    assert pool.num_free_blocks == 3
    pool.check_integrity()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([2], "double free of block 2: its ref_count is 0"),  # never allocated
        ([0, 0], "double free of block 0: its ref_count is 1"),  # freed twice in one call
        ([1, 0, 1], "double free of block 1: its ref_count is 1"),
        ([0, 99], "block id 99 is unknown: ids run from 0 to 2"),  # valid id, then unknown
        ([-1], "block id -1 is unknown"),
        ([3], "block id 3 is unknown"),
    ],
)
def test_double_free_or_unknown_id_raises_and_changes_nothing(bad: list[int], message: str) -> None:
    pool = BlockPool(3, BS)
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match=message):
        pool.free(bad)
    assert snapshot(pool) == before
    assert refs(pool) == [1, 1, 0]
    pool.check_integrity()
    # And the pool still works normally afterwards.
    pool.free([1, 0])
    assert pool.num_free_blocks == 3


def test_double_free_after_a_correct_free_raises() -> None:
    pool = BlockPool(2, BS)
    pool.allocate(1)
    pool.free([0])
    with pytest.raises(BlockPoolError, match="double free of block 0"):
        pool.free([0])
    assert pool.num_free_blocks == 2
    pool.check_integrity()


def test_unknown_block_lookup_raises() -> None:
    pool = BlockPool(2, BS)
    with pytest.raises(BlockPoolError, match="ids run from 0 to 1"):
        pool.block(2)


# ---------------------------------------------------------------------- eviction order
def test_uncached_free_blocks_go_before_cached_ones() -> None:
    pool = BlockPool(6, BS)
    seq = pool.allocate(4)  # 0..3
    register_chain(pool, ids(seq), TOKENS_A)
    pool.free([3, 2, 1, 0])  # a sequence frees its tail first
    # Blocks 4 and 5 (no hash) go first, then the least recently freed cached block: 3.
    assert ids(pool.allocate(3)) == [4, 5, 3]
    # The chain's head survives: a lookup still matches three blocks.
    assert lookup(pool, TOKENS_A) == [0, 1, 2]
    assert ids(pool.allocate(1)) == [2]
    assert lookup(pool, TOKENS_A) == [0, 1]
    pool.check_integrity()


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(4, BS)
    a = pool.allocate(2)  # 0, 1
    b = pool.allocate(2)  # 2, 3
    register_chain(pool, ids(a), TOKENS_A[:8])
    register_chain(pool, ids(b), TOKENS_B[:8])
    pool.free([1, 0])  # a first
    pool.free([3, 2])  # then b
    assert ids(pool.allocate(1)) == [1]
    assert lookup(pool, TOKENS_A[:8]) == [0]
    assert ids(pool.allocate(2)) == [0, 3]
    assert lookup(pool, TOKENS_A[:8]) == []
    assert lookup(pool, TOKENS_B[:8]) == [2]
    pool.check_integrity()


def test_a_reused_cached_block_becomes_most_recently_freed() -> None:
    pool = BlockPool(2, BS)
    pool.allocate(2)
    register_chain(pool, [0], TOKENS_A[:4])
    register_chain(pool, [1], TOKENS_B[:4])
    pool.free([0, 1])  # LRU order: 0, 1
    hit = pool.find_cached_prefix(chain_hashes(TOKENS_A[:4], BS), TOKENS_A[:4])
    assert ids(hit) == [0]
    pool.acquire(hit)
    pool.free([0])  # now LRU order: 1, 0
    assert ids(pool.allocate(1)) == [1]
    assert lookup(pool, TOKENS_B[:4]) == []
    assert lookup(pool, TOKENS_A[:4]) == [0]


def test_eviction_clears_the_block() -> None:
    pool = BlockPool(1, BS)
    (block,) = pool.allocate(1)
    register_chain(pool, [0], TOKENS_A[:4])
    pool.free([0])
    assert block.hash is not None
    pool.allocate(1)
    assert block.hash is None and block.parent_hash is None and block.token_ids == ()
    assert pool.stats().num_cached_blocks == 0


# ---------------------------------------------------------------------- the prefix index
def test_register_then_find_a_chain() -> None:
    pool = BlockPool(8, BS)
    blocks = pool.allocate(3)
    hashes = register_chain(pool, ids(blocks), TOKENS_A[:12])
    assert [b.hash for b in blocks] == hashes
    assert blocks[1].parent_hash == hashes[0]
    assert blocks[0].parent_hash is None
    assert blocks[2].token_ids == tuple(TOKENS_A[8:12])
    # A longer request with the same first 12 tokens matches all three blocks.
    assert lookup(pool, TOKENS_A) == [0, 1, 2]
    # A request diverging in block 1 matches block 0 only.
    diverging = TOKENS_A[:4] + [0] * 8
    assert lookup(pool, diverging) == [0]
    assert lookup(pool, TOKENS_B) == []
    pool.check_integrity()


def test_lookup_stops_at_the_first_miss() -> None:
    pool = BlockPool(3, BS)
    blocks = pool.allocate(3)
    register_chain(pool, ids(blocks), TOKENS_A[:12])
    pool.free([1])  # block 1 free and cached...
    pool.allocate(1)  # ...and now evicted
    # Block 2 is still indexed, but a chain only matches from its start.
    assert blocks[2].hash is not None
    assert lookup(pool, TOKENS_A[:12]) == [0]
    hashes = chain_hashes(TOKENS_A[:12], BS)
    assert pool.find_cached_prefix(hashes[1:], TOKENS_A[4:12]) == []


def test_lookup_with_partial_tokens_does_not_match() -> None:
    pool = BlockPool(2, BS)
    pool.allocate(1)
    hashes = register_chain(pool, [0], TOKENS_A[:4])
    # Hash of the full block, but only three tokens to compare: no match.
    assert pool.find_cached_prefix(hashes, TOKENS_A[:3]) == []


def test_find_does_not_mutate() -> None:
    pool = BlockPool(3, BS)
    pool.allocate(2)
    register_chain(pool, [0, 1], TOKENS_A[:8])
    pool.free([1, 0])
    before = snapshot(pool)
    assert lookup(pool, TOKENS_A[:8]) == [0, 1]
    assert snapshot(pool) == before


def test_collision_guard_on_tokens() -> None:
    pool = BlockPool(4, BS)
    pool.allocate(1)
    tokens = TOKENS_A[:4]
    real = chain_hashes(tokens, BS)[0]
    # Force a collision: store other tokens under the hash of `tokens`.
    pool.register(0, real, None, TOKENS_B[:4])
    assert lookup(pool, tokens) == []
    assert pool.find_cached_prefix([real], TOKENS_B[:4]) == [pool.block(0)]


def test_collision_guard_on_parent_hash() -> None:
    pool = BlockPool(4, BS)
    pool.allocate(2)
    hashes = chain_hashes(TOKENS_A[:8], BS)
    pool.register(0, hashes[0], None, TOKENS_A[:4])
    # Right tokens and hash for block 1, but recorded under another parent.
    pool.register(1, hashes[1], hashes[0] ^ 1, TOKENS_A[4:8])
    assert lookup(pool, TOKENS_A[:8]) == [0]
    # A block-0 candidate that claims a parent never matches at position 0.
    pool.allocate(1)
    other = chain_hashes(TOKENS_B[:4], BS)[0]
    pool.register(2, other, 12345, TOKENS_B[:4])
    assert lookup(pool, TOKENS_B[:4]) == []


def test_collision_does_not_hide_the_genuine_copy() -> None:
    pool = BlockPool(4, BS)
    pool.allocate(2)
    real = chain_hashes(TOKENS_A[:4], BS)[0]
    pool.register(0, real, None, TOKENS_B[:4])  # impostor under the same hash
    pool.register(1, real, None, TOKENS_A[:4])  # the genuine block
    assert lookup(pool, TOKENS_A[:4]) == [1]
    pool.check_integrity()


def test_duplicate_copies_keep_the_index_consistent() -> None:
    # nano-vLLM issue: two sequences compute the same new prefix in one step and both
    # register it. Evicting one copy must keep the other findable.
    pool = BlockPool(3, BS)
    pool.allocate(2)
    register_chain(pool, [0], TOKENS_A[:4])
    register_chain(pool, [1], TOKENS_A[:4])
    assert pool.stats().num_cached_blocks == 2
    pool.free([0])
    assert ids(pool.allocate(2)) == [2, 0]  # block 0 is evicted...
    assert lookup(pool, TOKENS_A[:4]) == [1]  # ...and block 1 is still found
    pool.free([1])
    assert lookup(pool, TOKENS_A[:4]) == [1]  # free but cached
    pool.free([0, 2])
    assert ids(pool.allocate(3)) == [0, 2, 1]
    assert lookup(pool, TOKENS_A[:4]) == []
    pool.check_integrity()


def test_duplicate_lookup_prefers_the_copy_in_use() -> None:
    pool = BlockPool(3, BS)
    pool.allocate(2)
    register_chain(pool, [0], TOKENS_A[:4])
    register_chain(pool, [1], TOKENS_A[:4])
    pool.free([0])  # copy 0 free, copy 1 in use
    assert lookup(pool, TOKENS_A[:4]) == [1]
    pool.free([1])
    pool.acquire([pool.block(0)])  # now copy 0 in use, copy 1 free
    assert lookup(pool, TOKENS_A[:4]) == [0]


def test_chains_match_across_duplicate_copies() -> None:
    # Block 1 was registered under a parent whose copy is now gone; the surviving copy of
    # the parent carries the same hash, so the chain still matches.
    pool = BlockPool(4, BS)
    pool.allocate(3)
    register_chain(pool, [0, 1], TOKENS_A[:8])
    register_chain(pool, [2], TOKENS_A[:4])
    pool.free([0])
    pool.allocate(2)  # evicts 0 (after the never-used block 3)
    assert lookup(pool, TOKENS_A[:8]) == [2, 1]


# -------------------------------------------------------------- acquire / admission cost
def test_in_use_hits_cost_nothing_free_hits_cost_one_each() -> None:
    pool = BlockPool(6, BS)
    a = pool.allocate(3)
    register_chain(pool, ids(a), TOKENS_A[:12])
    pool.free([2])  # block 2 free but cached
    hits = pool.find_cached_prefix(chain_hashes(TOKENS_A[:12], BS), TOKENS_A[:12])
    assert ids(hits) == [0, 1, 2]
    assert pool.cost_of_acquiring(hits) == 1
    free_before = pool.num_free_blocks
    pool.acquire(hits)
    assert pool.num_free_blocks == free_before - 1
    assert refs(pool) == [2, 2, 1, 0, 0, 0]
    # Allocation can no longer evict the resurrected block.
    assert ids(pool.allocate(3)) == [3, 4, 5]
    assert lookup(pool, TOKENS_A[:12]) == [0, 1, 2]
    pool.check_integrity()


def test_shared_blocks_stay_in_use_until_the_last_reference_goes() -> None:
    pool = BlockPool(4, BS)
    a = pool.allocate(2)
    register_chain(pool, ids(a), TOKENS_A[:8])
    for _ in range(3):
        pool.acquire(pool.find_cached_prefix(chain_hashes(TOKENS_A[:8], BS), TOKENS_A[:8]))
    assert refs(pool) == [4, 4, 0, 0]
    for _ in range(3):
        pool.free([1, 0])
    assert refs(pool) == [1, 1, 0, 0]
    assert pool.num_free_blocks == 2
    pool.free([1, 0])
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_acquire_refuses_uncached_or_foreign_blocks_and_changes_nothing() -> None:
    pool = BlockPool(3, BS)
    blocks = pool.allocate(2)
    register_chain(pool, [0], TOKENS_A[:4])
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match=r"Block\(id=1, .*is not a cached block"):
        pool.acquire([blocks[0], blocks[1]])  # block 1 has no hash
    with pytest.raises(BlockPoolError, match=r"Block\(id=0, .*is not a cached block"):
        pool.acquire([Block(0)])  # not this pool's block object
    assert snapshot(pool) == before


def blank(pool: BlockPool) -> list[int]:
    """Ids of the blocks that carry no cached content at all (no hash, parent, tokens)."""
    return [
        block_id
        for block_id in range(pool.num_blocks)
        if (pool.block(block_id).hash, pool.block(block_id).parent_hash) == (None, None)
        and pool.block(block_id).token_ids == ()
    ]


def test_blocks_are_blank_when_new_after_eviction_and_after_a_reset() -> None:
    pool = BlockPool(3, BS)
    assert blank(pool) == [0, 1, 2]
    blocks = pool.allocate(2)
    register_chain(pool, ids(blocks), TOKENS_A[:8])
    assert blank(pool) == [2]
    pool.free([1, 0])
    pool.allocate(2)  # 2 (never cached), then 1 (the least recently freed): evicted
    assert blank(pool) == [1, 2]
    assert pool.block(0).parent_hash is None and pool.block(0).token_ids == tuple(TOKENS_A[:4])
    pool.reset_prefix_cache()
    assert blank(pool) == [0, 1, 2]
    pool.check_integrity()


# ------------------------------------------------------------------------------ share
def free_order(pool: BlockPool) -> list[int]:
    """The ids the free lists would hand out next, in order (observed on a copy)."""
    return ids(copy.deepcopy(pool).allocate(pool.num_free_blocks))


def test_share_takes_one_more_reference_per_id() -> None:
    pool = BlockPool(5, BS)
    pool.allocate(3)  # 0, 1, 2
    pool.share([0, 2])
    assert refs(pool) == [2, 1, 2, 0, 0]
    pool.share([2, 2, 0])  # an id listed twice gains two references
    assert refs(pool) == [3, 1, 4, 0, 0]
    pool.share([])
    assert refs(pool) == [3, 1, 4, 0, 0]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (2, 3)
    assert free_order(pool) == [3, 4]  # sharing touches no free list
    pool.check_integrity()


@pytest.mark.parametrize(
    ("frees", "free_after", "reuse"),
    [
        # The owner first, then the sharer: the second call drops the last references.
        ([[1, 0], [1, 0]], [2, 4], [2, 3, 1, 0]),
        ([[0], [0], [1], [1]], [2, 3, 3, 4], [2, 3, 0, 1]),  # one reference at a time
        ([[0, 0], [1, 1]], [3, 4], [2, 3, 0, 1]),  # both references of a block in one call
        ([[1, 1, 0, 0]], [4], [2, 3, 1, 0]),  # everything in one call
    ],
    ids=["owner-then-sharer", "one-by-one", "block-by-block", "one-call"],
)
def test_a_shared_block_is_free_only_after_its_last_reference(
    frees: list[list[int]], free_after: list[int], reuse: list[int]
) -> None:
    pool = BlockPool(4, BS)
    pool.allocate(2)  # 0, 1
    pool.share([0, 1])
    for block_ids, num_free in zip(frees, free_after, strict=True):
        pool.free(block_ids)
        pool.check_integrity()
        assert pool.num_free_blocks == num_free
    assert refs(pool) == [0, 0, 0, 0]
    # An uncached block joins the back of the FIFO when its last reference goes: the block
    # whose last reference went first is reused first (after the never-used 2 and 3).
    assert free_order(pool) == reuse


def test_freeing_a_shared_cached_block_keeps_it_findable_until_evicted() -> None:
    pool = BlockPool(4, BS)
    blocks = pool.allocate(2)
    register_chain(pool, ids(blocks), TOKENS_A[:8])
    pool.share([0, 1])  # a second completion reads the same prompt blocks
    pool.free([1, 0])
    assert refs(pool) == [1, 1, 0, 0]
    assert lookup(pool, TOKENS_A[:8]) == [0, 1]
    assert free_order(pool) == [2, 3]  # still in use: on no free list
    pool.free([1, 0])  # the last references: onto the cached free list, tail first
    assert pool.num_free_blocks == 4 and pool.stats().num_cached_blocks == 2
    assert lookup(pool, TOKENS_A[:8]) == [0, 1]
    assert free_order(pool) == [2, 3, 1, 0]  # uncached first, then least recently freed
    pool.check_integrity()


def test_a_cached_block_on_the_free_list_is_acquired_not_shared() -> None:
    pool = BlockPool(3, BS)
    blocks = pool.allocate(1)
    register_chain(pool, ids(blocks), TOKENS_A[:4])
    pool.free([0])  # cached and free: findable, on the cached free list
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match="block 0 is free: only blocks in use are shared"):
        pool.share([0])
    assert snapshot(pool) == before
    (found,) = pool.find_cached_prefix(chain_hashes(TOKENS_A[:4], BS), TOKENS_A[:4])
    pool.acquire([found])  # the way to take it back: off the free list, reference 1
    assert refs(pool) == [1, 0, 0] and free_order(pool) == [1, 2]
    pool.share([0])  # in use now: it can be shared
    assert refs(pool) == [2, 0, 0]
    pool.check_integrity()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([2], "block 2 is free: only blocks in use are shared"),  # never allocated
        ([0, 2], "block 2 is free"),  # a block in use, then a free one
        ([0, 1, 3], "block 3 is free"),  # a free cached block after blocks in use
        ([0, 5], "block id 5 is unknown: ids run from 0 to 4"),
        ([1, -1], "block id -1 is unknown"),
    ],
)
def test_share_of_a_free_or_unknown_block_raises_and_changes_nothing(
    bad: list[int], message: str
) -> None:
    pool = BlockPool(5, BS)
    blocks = pool.allocate(4)  # 0, 1, 2, 3
    register_chain(pool, [3], TOKENS_A[:4])
    pool.free([3, 2])  # 3 is cached and free, 2 uncached and free
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match=message):
        pool.share(bad)
    assert snapshot(pool) == before
    assert refs(pool) == [1, 1, 0, 0, 0]
    assert ids(blocks[:2]) == [0, 1]
    pool.check_integrity()


# ------------------------------------------------------------------------- registration
def test_register_refuses_free_registered_or_partial_blocks() -> None:
    pool = BlockPool(3, BS)
    pool.allocate(1)
    digest = block_hash(TOKENS_A[:4], None)
    with pytest.raises(BlockPoolError, match="free block 1"):
        pool.register(1, digest, None, TOKENS_A[:4])
    with pytest.raises(BlockPoolError, match="only full blocks"):
        pool.register(0, digest, None, TOKENS_A[:3])
    pool.register(0, digest, None, TOKENS_A[:4])
    with pytest.raises(BlockPoolError, match="already registered"):
        pool.register(0, digest, None, TOKENS_A[:4])
    with pytest.raises(BlockPoolError, match="block id 7 is unknown"):
        pool.register(7, digest, None, TOKENS_A[:4])
    assert pool.stats().num_cached_blocks == 1
    pool.check_integrity()


def test_disabled_prefix_caching_never_indexes_or_finds() -> None:
    pool = BlockPool(3, BS, enable_prefix_caching=False)
    pool.allocate(2)
    register_chain(pool, [0, 1], TOKENS_A[:8])
    assert pool.block(0).hash is None
    assert lookup(pool, TOKENS_A[:8]) == []
    pool.free([1, 0])
    assert ids(pool.allocate(3)) == [2, 1, 0]
    pool.check_integrity()


# -------------------------------------------------------------------- stats and reset
def test_stats_add_up() -> None:
    pool = BlockPool(8, BS)
    blocks = pool.allocate(5)
    register_chain(pool, ids(blocks[:3]), TOKENS_A[:12])
    pool.free([4, 2])
    pool.record_prefix_lookup(12, 8)
    pool.record_prefix_lookup(4, 0)
    stats = pool.stats()
    assert stats.num_blocks == 8
    assert stats.num_free_blocks == 5
    assert stats.num_used_blocks == 3
    assert stats.num_free_blocks + stats.num_used_blocks == stats.num_blocks
    assert stats.num_cached_blocks == 3  # two in use, one free
    assert stats.usage == pytest.approx(3 / 8) == pool.usage
    assert stats.prefix_query_tokens == 16
    assert stats.prefix_hit_tokens == 8
    assert stats.prefix_hit_rate == pytest.approx(0.5)


def test_hit_rate_without_queries_is_zero() -> None:
    assert BlockPool(1, BS).stats().prefix_hit_rate == 0.0


def test_reset_prefix_cache_forgets_everything_but_keeps_allocations() -> None:
    pool = BlockPool(5, BS)
    blocks = pool.allocate(4)
    register_chain(pool, ids(blocks), TOKENS_A)
    pool.free([3, 2])
    pool.reset_prefix_cache()
    assert lookup(pool, TOKENS_A) == []
    assert refs(pool) == [1, 1, 0, 0, 0]
    assert pool.num_free_blocks == 3
    assert pool.stats().num_cached_blocks == 0
    assert all(pool.block(i).hash is None for i in range(5))
    pool.check_integrity()
    # Former cached blocks are plain free blocks now, reused after the never-used one.
    assert ids(pool.allocate(3)) == [4, 3, 2]
    # In-use blocks can be registered again and freed normally.
    register_chain(pool, [0, 1], TOKENS_B[:8])
    assert lookup(pool, TOKENS_B[:8]) == [0, 1]
    pool.free([1, 0, 4, 3, 2])
    assert pool.num_free_blocks == 5
    pool.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    pool = BlockPool(2, BS)
    pool.allocate(1)
    pool.block(0).ref_count = 0  # corrupt on purpose: ref 0 but not on the free list
    with pytest.raises(BlockPoolError, match=r"Block\(id=0, .*free-list membership disagrees"):
        pool.check_integrity()
