"""The scheduler state machine with a host KV tier behind a small device pool.

The machine of ``test_scheduler_machine.py`` (fake KV cache whose reads decide the next
token, the oracle, aborts, stop strings, abandoned plans, prefix-cache resets, n > 1, small
pools that preempt) with ``num_host_blocks`` host slots. The fake executor also runs the plans'
``kv_copies_out`` (device block -> host slot, before anything else) and ``kv_copies_in`` (host
slot -> device block), on a fake host store: a block found in the tier with the wrong K/V, a
copy in that is read before it landed, or a copy out that ran after its device block was
overwritten changes the outputs. Invariants: every host slot is free, copying out, resident or
copying in, exactly once (``HostTier.check_integrity``); the tier never holds more than its
slots; hashes chain across tiers (a block found in the tier continues the device's chain); a
request waiting for its copies has counted none of them as computed; aborts and preemptions
while a copy is in flight give everything back (the pool is all free when idle, the tier
holds nothing in flight).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from pagedinfer.domain import BatchPlan, Scheduler, SequenceStatus, cdiv
from pagedinfer.domain.host_tier import SlotState

from .profiles import sized
from .test_async_scheduler_machine import AsyncSchedulerMachine
from .test_scheduler_machine import SETUP, SchedulerMachine


class TierSchedulerMachine(SchedulerMachine):
    @initialize(**SETUP, host_blocks=st.integers(1, 12))
    def setup(self, host_blocks: int, **base: Any) -> None:  # type: ignore[override]
        base["caching"] = True  # the tier sits behind the prefix cache
        SchedulerMachine.setup(self, **base)
        self.config = dataclasses.replace(self.config, num_host_blocks=host_blocks)
        self.scheduler = Scheduler(self.config)
        self.host: dict[int, list[tuple[int, int] | None]] = {}  # slot -> a block's entries

    def check_plan(self, plan: BatchPlan) -> None:
        tier = self.scheduler.host_tier
        assert tier is not None
        for block, slot in plan.kv_copies_out:
            assert tier.entry(slot).state is SlotState.COPYING_OUT
            assert 0 <= block < self.config.num_blocks
        for slot, block in plan.kv_copies_in:
            assert tier.entry(slot).state is SlotState.COPYING_IN
            holders = [s for s in self.scheduler.running if block in s.block_table]
            assert len(holders) == 1 and holders[0].seq_id in self.scheduler.loading_seq_ids
        if plan.num_seqs == 0:  # a plan that only moves blocks between the tiers
            assert plan.kv_copies_out or plan.kv_copies_in
            assert plan.num_samples == 0 and plan.num_tokens == 0
            event("a copy-only plan")
            return
        super().check_plan(plan)

    def apply_deltas_and_copies(self, plan: BatchPlan) -> None:
        self.copy_between_tiers(plan)
        super().apply_deltas_and_copies(plan)

    def copy_between_tiers(self, plan: BatchPlan) -> None:
        size = plan.block_size
        for block, slot in plan.kv_copies_out:  # first: this step may overwrite the block
            self.host[slot] = [self.kv.get(block * size + offset) for offset in range(size)]
        for slot, block in plan.kv_copies_in:
            for offset, entry in enumerate(self.host[slot]):
                if entry is None:
                    self.kv.pop(block * size + offset, None)
                else:
                    self.kv[block * size + offset] = entry
        if plan.kv_copies_in:
            event("copied blocks in from the host tier")

    @invariant()
    def tier_integrity(self) -> None:
        tier = self.scheduler.host_tier
        assert tier is not None
        tier.check_integrity()
        stats = tier.stats()
        assert stats.num_used_slots <= stats.num_slots
        loading = self.scheduler.loading_seq_ids
        running = {seq.seq_id: seq for seq in self.scheduler.running}
        assert loading <= set(running), "a request waits for copies without running"
        for seq_id in loading:
            seq = running[seq_id]
            assert seq.status is SequenceStatus.RUNNING and not seq.decoding
        # Resident blocks chain: their parent is block i - 1 of the same chain (recorded
        # with the block when it left the device).
        for slot in range(tier.num_slots):
            try:
                entry = tier.entry(slot)
            except Exception:
                continue
            assert len(entry.token_ids) == self.config.block_size

    def running_sequences_hold_exactly_what_they_computed(self) -> None:
        loading = self.scheduler.loading_seq_ids
        size = self.config.block_size
        for seq in self.scheduler.running:
            if seq.seq_id in loading:  # it holds the blocks being copied in, not computed
                assert cdiv(seq.num_computed_tokens, size) < len(seq.block_table)
        if not loading:
            super().running_sequences_hold_exactly_what_they_computed()

    def teardown(self) -> None:
        super().teardown()
        tier = self.scheduler.host_tier
        assert tier is not None
        stats = tier.stats()
        assert stats.num_copying_in == 0, "an idle scheduler still copies blocks in"
        if stats.blocks_copied_in:
            event("prefix hit in the host tier")


TestTierSchedulerMachine = TierSchedulerMachine.TestCase
TestTierSchedulerMachine.settings = sized(
    {
        "ci": {"max_examples": 60, "stateful_step_count": 30},
        "quick": {"max_examples": 15, "stateful_step_count": 20},
        "thorough": {"max_examples": 1500, "stateful_step_count": 80},
    }
)


class AsyncTierSchedulerMachine(AsyncSchedulerMachine, TierSchedulerMachine):
    """The same with async scheduling: plans made ahead of the plan in flight's tokens, so a
    copy sent with one plan lands when that plan is recorded, after the next was made."""

    def execute_with(self, plan: BatchPlan, previous_tokens: list[int] | None) -> list[int]:
        self.copy_between_tiers(plan)
        return super().execute_with(plan, previous_tokens)


TestAsyncTierSchedulerMachine = AsyncTierSchedulerMachine.TestCase
TestAsyncTierSchedulerMachine.settings = sized(
    {
        "ci": {"max_examples": 25, "stateful_step_count": 30},
        "quick": {"max_examples": 15, "stateful_step_count": 20},
        "thorough": {"max_examples": 1000, "stateful_step_count": 80},
    }
)
