"""KV groups (hybrid attention): the layer layout, the window arithmetic, the grouped allocator."""

from __future__ import annotations

import pytest

from pagedinfer.domain import BlockPool, SamplingParams, Sequence
from pagedinfer.domain.kv_groups import (
    KVGroupLayout,
    KVGroupSpec,
    group_block_key,
    group_layers,
    min_blocks_for_one_sequence,
)
from pagedinfer.domain.scheduler import Scheduler, SchedulerConfig
from pagedinfer.domain.scheduler.group_allocator import GroupedBlockAllocator
from pagedinfer.domain.sliding_window import (
    first_visible_block,
    longest_window_hit,
    max_live_blocks,
)
from pagedinfer.errors import ConfigurationError, InvalidRequestError


def test_one_kind_is_one_group_of_every_layer() -> None:
    assert group_layers([None] * 4) == (KVGroupSpec(None, (0, 1, 2, 3)),)
    assert group_layers([8, 8]) == (KVGroupSpec(8, (0, 1)),)


def test_gemma3_pattern_splits_sliding_layers_into_groups_of_the_full_count() -> None:
    # Five sliding layers to one full, 12 layers: 2 full, 10 sliding -> groups of 2.
    windows = [None if (layer + 1) % 6 == 0 else 512 for layer in range(12)]
    groups = group_layers(windows)
    assert groups[0] == KVGroupSpec(None, (5, 11))  # full first: group 0 keys as before
    assert [g.layers for g in groups[1:]] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    layout = KVGroupLayout.of(groups)
    assert layout.layers_per_group == 2 and layout.num_groups == 6
    assert layout.group_of_layer[5] == 0 and layout.slot_of_layer[11] == 1
    assert layout.group_of_layer[6] == 3 and layout.slot_of_layer[6] == 1
    assert layout.windows == tuple(windows)


def test_alternating_layers_make_two_groups_and_uneven_counts_pad_the_last() -> None:
    assert [g.layers for g in group_layers([128, None] * 3)] == [(1, 3, 5), (0, 2, 4)]
    groups = group_layers([None, 4, 4, 4, None])  # 2 full, 3 sliding: the last group has 1
    assert [g.layers for g in groups] == [(0, 4), (1, 2), (3,)]
    assert KVGroupLayout.of(groups).layers_per_group == 2


def test_bad_groups_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="window"):
        KVGroupSpec(0, (0,))
    with pytest.raises(ConfigurationError, match="two KV groups"):
        KVGroupLayout.of([KVGroupSpec(None, (0, 1)), KVGroupSpec(4, (1,))])
    with pytest.raises(ConfigurationError, match=r"expected 0 \.\. 1"):
        KVGroupLayout.of([KVGroupSpec(None, (0, 2))])


def test_group_zero_keys_by_the_chained_hash_and_others_apart() -> None:
    assert group_block_key(1234, 0) == 1234
    assert len({group_block_key(1234, g) for g in range(4)}) == 4


def test_window_arithmetic() -> None:
    # Window 8, blocks of 4: the query at 12 sees 5..12, from block 1 on.
    assert first_visible_block(12, 8, 4) == 1
    assert first_visible_block(11, 8, 4) == 1 and first_visible_block(7, 8, 4) == 0
    assert first_visible_block(13, 8, 4) == 1 and first_visible_block(15, 8, 4) == 2
    assert max_live_blocks(8, 4) == 3 and max_live_blocks(8, 4, num_tokens=9) == 5
    cached = {2, 3, 4, 6}
    # k=5: blocks 3..4 needed (first visible at 20 is (20-7)//4 = 3) -> cached.
    assert longest_window_hit(cached.__contains__, 7, 8, 4) == 5
    assert longest_window_hit(cached.__contains__, 4, 8, 4) == 4  # blocks 2..3
    assert longest_window_hit(set().__contains__, 7, 8, 4) == 0


def test_min_blocks_counts_every_group_and_the_null_block() -> None:
    full = KVGroupSpec(None, (0,))
    sliding = KVGroupSpec(8, (1,))
    assert min_blocks_for_one_sequence([full], 4, 64, 16) == 16
    # 16 (full) + min(16, 2 + 1 + 2 * 4) + 1 (null)
    assert min_blocks_for_one_sequence([full, sliding], 4, 64, 16) == 16 + 11 + 1
    with pytest.raises(ConfigurationError, match="needs 28"):
        SchedulerConfig(
            num_blocks=27,
            block_size=4,
            max_model_len=64,
            max_num_batched_tokens=16,
            kv_groups=(full, sliding),
        )


GROUPS = (KVGroupSpec(None, (0,)), KVGroupSpec(8, (1,)))


def allocator(num_blocks: int = 40) -> GroupedBlockAllocator:
    return GroupedBlockAllocator(BlockPool(num_blocks, 4), GROUPS)


def run_prefill(alloc: GroupedBlockAllocator, seq: Sequence, chunk: int) -> None:
    """Admit ``seq`` and compute its prompt in chunks, recording each."""
    admission = alloc.admit(seq, chunk)
    assert admission is not None
    seq.num_computed_tokens = admission.num_cached + admission.num_tokens
    alloc.register_full_blocks(seq)
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        assert alloc.allocate_slots(seq, n) is not None
        seq.num_computed_tokens += n
        alloc.register_full_blocks(seq)


def test_the_null_block_is_held_and_sliding_blocks_leave_with_the_window() -> None:
    alloc = allocator()
    pool = alloc.pool
    assert alloc.null_block == 0 and pool.block(0).ref_count == 1
    seq = Sequence(1, list(range(1, 31)))
    run_prefill(alloc, seq, 4)
    # 30 computed: the next query (30) sees 23..30, blocks 5..7; 0..4 are out of the window.
    assert len(seq.block_table) == len(seq.group_block_tables[0]) == 8
    assert seq.group_block_tables[0][:5] == [0] * 5
    assert len(alloc.live_blocks(seq, 1)) == 3 <= max_live_blocks(8, 4)
    assert len(alloc.live_blocks(seq, 0)) == 8
    assert pool.num_used_blocks == 1 + 8 + 3
    alloc.free(seq)
    assert pool.num_used_blocks == 1 and seq.group_block_tables == []
    pool.check_integrity()


def test_a_sliding_group_hits_with_only_its_last_window_cached() -> None:
    alloc = allocator()
    prompt = list(range(1, 31))
    first = Sequence(1, prompt)
    run_prefill(alloc, first, 8)
    alloc.free(first)  # its blocks stay cached (freed, with their hashes)
    second = Sequence(2, [*prompt, 99, 98])
    admission = alloc.admit(second, 64)
    assert admission is not None
    # Both groups hold blocks 0..6 cached (7 full blocks of the 30 tokens, 28 tokens).
    assert admission.num_cached == 28
    assert second.group_block_tables[0][:5] == [0] * 5  # first visible at 28: block 5
    assert alloc.pool.stats().prefix_hit_tokens == 28


def test_a_sliding_hit_needs_the_window_before_it() -> None:
    alloc = allocator(60)
    prompt = list(range(1, 31))
    first = Sequence(1, prompt)
    run_prefill(alloc, first, 8)
    # Another prompt sharing only the first 12 tokens: the full group has blocks 0..2, but
    # the sliding group freed blocks 0..4 of the first request; they are cached (freed with
    # their hashes), so the hit is 12 tokens with the window's blocks 1..2.
    second = Sequence(2, prompt[:12] + [77] * 10)
    admission = alloc.admit(second, 64)
    assert admission is not None and admission.num_cached == 12
    alloc.free(second)
    alloc.pool.reset_prefix_cache()
    third = Sequence(3, prompt[:12] + [66] * 10)
    assert alloc.admit(third, 64) == type(admission)(0, 22)


def test_a_failed_admission_changes_nothing() -> None:
    alloc = allocator(9)  # null + 8: a 5-block prompt needs 10
    seq = Sequence(1, list(range(1, 20)), SamplingParams())
    before = alloc.pool.num_free_blocks
    assert alloc.admit(seq, 64) is None
    assert alloc.pool.num_free_blocks == before and seq.block_table == []


def test_forks_share_every_group_and_copy_each_partial_block() -> None:
    alloc = allocator()
    parent = Sequence(1, list(range(1, 31)))
    run_prefill(alloc, parent, 30)
    child = Sequence(2, list(range(1, 31)))
    copies = alloc.fork_blocks(parent, child)
    assert len(copies) == 2  # one partial block per group
    assert child.block_table[:7] == parent.block_table[:7]
    assert child.group_block_tables[0][:5] == [0] * 5
    for (source, target), table in zip(copies, alloc.tables(child), strict=True):
        assert table[-1] == target and alloc.pool.block(source).ref_count == 2
    alloc.pool.free([source for source, _ in copies])
    alloc.free(child)
    alloc.free(parent)
    assert alloc.pool.num_used_blocks == 1
    alloc.pool.check_integrity()


def test_the_scheduler_reports_each_groups_blocks() -> None:
    config = SchedulerConfig(
        num_blocks=60, block_size=4, max_model_len=64, max_num_batched_tokens=16, kv_groups=GROUPS
    )
    scheduler = Scheduler(config)
    seq = Sequence(1, list(range(1, 31)), SamplingParams(max_tokens=4, ignore_eos=True))
    scheduler.add(seq)
    while seq.num_computed_tokens < 30:
        plan = scheduler.schedule()
        assert plan is not None and len(plan.group_block_tables) == 1
        scheduler.postprocess(plan, [5] * plan.num_samples)
    full, sliding = scheduler.kv_group_usage()
    assert (full.window, full.num_blocks_held, full.max_blocks_per_sequence) == (None, 8, None)
    assert (sliding.window, sliding.num_blocks_held, sliding.max_blocks_per_sequence) == (8, 3, 3)
    plain = SchedulerConfig(num_blocks=60, block_size=4, max_model_len=64)
    assert Scheduler(plain).kv_group_usage() == ()


def test_forks_of_a_prompt_longer_than_the_window_fit_by_its_window_not_its_length() -> None:
    """n > 1 is admitted when the prompt's window fits in the sliding group: the check once
    counted the whole prompt in every group and refused requests the pool runs."""
    config = SchedulerConfig(
        num_blocks=30, block_size=4, max_model_len=64, max_num_batched_tokens=16, kv_groups=GROUPS
    )
    scheduler = Scheduler(config)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = list(range(1, 51))  # 13 blocks: 2 x (13 + 2 copies) + 1 = 31 > 30 blocks
    seq = Sequence(1, prompt, params)
    scheduler.add(seq, [Sequence(2, prompt, params), Sequence(3, prompt, params)])
    for _ in range(100):
        plan = scheduler.schedule()
        if plan is None:
            break
        scheduler.postprocess(plan, [5] * plan.num_samples)
    assert not scheduler.has_unfinished()
    assert scheduler.pool.num_used_blocks == 1  # the null block
    longer = list(range(1, 63))  # full: 16 + 2 copies; sliding: 11 + 2; the null block
    with pytest.raises(InvalidRequestError, match="n=3 completions need 32 KV blocks"):
        scheduler.add(Sequence(4, longer, params), [Sequence(i, longer, params) for i in (5, 6)])
    scheduler.check_integrity()
