"""BlockAllocator: blocks or None, and a refusal changes nothing (as vLLM's KV manager)."""

from __future__ import annotations

from pagedinfer.domain import BlockPool, SamplingParams, Sequence
from pagedinfer.domain.scheduler.allocator import Admission, BlockAllocator


def allocator(num_blocks: int = 8, *, caching: bool = True) -> BlockAllocator:
    return BlockAllocator(BlockPool(num_blocks, 4, enable_prefix_caching=caching))


def ref_counts(alloc: BlockAllocator) -> list[int]:
    return [alloc.pool.block(i).ref_count for i in range(alloc.pool.num_blocks)]


def test_allocate_slots_gives_the_missing_blocks_or_none() -> None:
    alloc = allocator(num_blocks=3)
    seq = Sequence(0, list(range(16)))
    assert alloc.allocate_slots(seq, 5) is not None  # positions 0..4: two blocks
    assert len(seq.block_table) == 2
    assert alloc.allocate_slots(seq, 3) == []  # positions 0..2: held already
    before = (list(seq.block_table), ref_counts(alloc))
    assert alloc.allocate_slots(seq, 13) is None  # 0..12 needs four: two missing, one free
    assert (seq.block_table, ref_counts(alloc)) == before
    assert alloc.allocate_slots(seq, 9) == [seq.block_table[2]]  # 0..8: the third block


def test_a_reserve_is_kept_free() -> None:
    alloc = allocator(num_blocks=2)
    seq = Sequence(0, [1, 2, 3])
    assert alloc.allocate_slots(seq, 3, reserve=2) is None
    assert seq.block_table == [] and alloc.num_free_blocks == 2
    new = alloc.allocate_slots(seq, 3, reserve=1)
    assert new == seq.block_table and len(new) == 1


def test_growth_capacity_and_opens_block() -> None:
    alloc = allocator(num_blocks=4)
    seq = Sequence(0, list(range(6)))
    assert alloc.growth_capacity(seq) == 16
    alloc.allocate_slots(seq, 4)
    seq.num_computed_tokens = 4
    assert alloc.opens_block(seq)  # token 4 is the first of block 1, not held
    assert alloc.growth_capacity(seq) == 12
    assert alloc.blocks_missing(seq, 2) == 1


def test_admit_finds_the_cached_prefix_and_keeps_one_token_to_compute() -> None:
    alloc = allocator()
    first = Sequence(0, list(range(8)))
    assert alloc.admit(first, budget=8) == Admission(num_cached=0, num_tokens=8)
    first.num_computed_tokens = 8
    alloc.register_full_blocks(first)
    assert first.num_registered_blocks == 2
    same = Sequence(1, list(range(8)))
    # Fully cached, but the last block is recomputed: logits need one computed token.
    assert alloc.admit(same, budget=8) == Admission(num_cached=4, num_tokens=4)
    assert same.block_table[0] == first.block_table[0]
    assert alloc.pool.block(first.block_table[0]).ref_count == 2


def test_prompt_logprobs_skip_the_cache() -> None:
    alloc = allocator()
    first = Sequence(0, list(range(8)))
    alloc.admit(first, budget=8)
    first.num_computed_tokens = 8
    alloc.register_full_blocks(first)
    wants_logprobs = Sequence(1, list(range(8)), SamplingParams(prompt_logprobs=1))
    admission = alloc.admit(wants_logprobs, budget=8)
    assert admission == Admission(num_cached=0, num_tokens=8)


def test_a_refused_admission_changes_nothing() -> None:
    alloc = allocator(num_blocks=2)
    seq = Sequence(0, list(range(8)))
    counts = ref_counts(alloc)
    assert alloc.admit(seq, budget=8, reserve_if_whole=1) is None  # 2 blocks + 1 reserved
    assert seq.block_table == [] and ref_counts(alloc) == counts
    # A chunk that does not reach the end reserves nothing.
    assert alloc.admit(seq, budget=4, reserve_if_whole=1) == Admission(0, 4)


def test_append_block_trim_and_free() -> None:
    alloc = allocator(num_blocks=2)
    seq = Sequence(0, [1])
    assert alloc.append_block(seq) is not None
    assert alloc.append_block(seq) is not None
    assert alloc.append_block(seq) is None
    assert len(seq.block_table) == 2
    alloc.trim(seq, 1)
    assert len(seq.block_table) == 1 and alloc.num_free_blocks == 1
    alloc.free(seq)
    assert seq.block_table == [] and alloc.num_free_blocks == 2


def test_lookahead_blocks_only_as_far_as_free_blocks_go() -> None:
    alloc = allocator(num_blocks=3)
    seq = Sequence(0, list(range(4)))
    alloc.allocate_slots(seq, 4)
    alloc.allocate_lookahead(seq, 4, lookahead=100)  # wants many, two are free
    assert len(seq.block_table) == 3 and alloc.num_free_blocks == 0


def test_without_prefix_caching_nothing_is_registered() -> None:
    alloc = allocator(caching=False)
    seq = Sequence(0, list(range(8)))
    alloc.admit(seq, budget=8)
    seq.num_computed_tokens = 8
    alloc.register_full_blocks(seq)
    assert seq.num_registered_blocks == 0
