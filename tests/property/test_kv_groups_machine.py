"""The scheduler state machines with hybrid attention: several KV groups, sliding windows.

The machines of ``test_scheduler_machine.py`` (synchronous) and
``test_async_scheduler_machine.py`` (a step planned ahead) with the model's layers in KV
groups drawn from: one sliding group (Mistral's window), full + sliding (GPT-OSS), full + two
sliding groups (Gemma 3). The fake KV cache is one slot space (the groups share the pool);
each step writes every new token into every group's blocks, and every row reads back what its
queries can see through each group's table: the whole context in a full group, the window
before its first query in a sliding one. A block freed out of the window too early, a
sliding prefix hit that served the wrong blocks, or a fork copy missing in one group reads
wrong K/V. Invariants per group: ref counts equal the holders in every table (the null block
held once, by the manager), a running sequence's sliding group holds at most
``ceil(window / block_size) + 1`` blocks between steps, and an idle pool is free but for the
null block.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from pagedinfer.domain import BatchPlan, Scheduler, Sequence, cdiv
from pagedinfer.domain.kv_groups import (
    KVGroupSpec,
    blocks_for_one_sequence,
    min_blocks_for_one_sequence,
)
from pagedinfer.domain.plan import PENDING_TOKEN
from pagedinfer.domain.scheduler.group_allocator import GroupedBlockAllocator
from pagedinfer.domain.sliding_window import max_live_blocks

from .profiles import sized
from .test_async_scheduler_machine import AsyncSchedulerMachine
from .test_scheduler_machine import SETUP, SchedulerMachine, fake_sample
from .test_spec_scheduler_machine import SpecSchedulerMachine

# Windows per group, group 0 first (full groups come first, as group_layers orders them).
GROUP_WINDOWS = st.sampled_from([(3,), (5,), (None, 4), (None, 9), (None, 2, 2), (None, 6, 6)])


def make_groups(windows: tuple[int | None, ...]) -> tuple[KVGroupSpec, ...]:
    return tuple(KVGroupSpec(window, (layer,)) for layer, window in enumerate(windows))


class GroupsMixin(SchedulerMachine):
    """What the grouped machines add to a scheduler machine."""

    windows: tuple[int | None, ...]

    @initialize(**SETUP, windows=GROUP_WINDOWS)
    def setup(self, windows: tuple[int | None, ...], **base: Any) -> None:  # type: ignore[override]
        SchedulerMachine.setup(self, **base)
        self.use_groups(windows)

    def use_groups(self, windows: tuple[int | None, ...]) -> None:
        """The drawn config with these groups, and a pool as small as they allow (plus the
        drawn spare blocks)."""
        groups = make_groups(windows)
        config = self.config
        needed = min_blocks_for_one_sequence(
            groups, config.block_size, config.max_model_len, config.max_num_batched_tokens
        )
        spare = config.num_blocks - cdiv(config.max_model_len, config.block_size)
        self.config = dataclasses.replace(config, num_blocks=needed + spare, kv_groups=groups)
        self.scheduler = Scheduler(self.config)
        self.windows = windows
        event(f"groups {windows}")

    @property
    def allocator(self) -> GroupedBlockAllocator:
        allocator = self.scheduler._allocator
        assert isinstance(allocator, GroupedBlockAllocator)
        return allocator

    def fork_blocks(self, prompt_len: int, n: int) -> int:
        """A full group's table for the prompt; a sliding group's for its window and the
        chunks in flight; the forks' copies of the last partial block in every group; the
        null block."""
        config = self.config
        return blocks_for_one_sequence(
            config.kv_groups,
            config.block_size,
            prompt_len,
            config.max_num_batched_tokens,
            copies=(n - 1) * (prompt_len % config.block_size != 0),
        )

    def write_and_read(
        self, plan: BatchPlan, inputs: list[int], history: dict[int, list[int]]
    ) -> None:
        """Store every row's new tokens in every group's blocks at the plan's slots for that
        group, then check what its queries see in each group through the plan's tables
        (``history``: each row's true tokens up to its context length)."""
        size = plan.block_size
        width = plan.block_table_width
        null = self.allocator.null_block
        assert (
            len(plan.group_block_tables) == len(plan.group_slot_mappings) == len(self.windows) - 1
        )
        slot_mappings = [plan.slot_mapping, *plan.group_slot_mappings]
        all_tables = [plan.block_tables, *plan.group_block_tables]
        for g, slots in enumerate(slot_mappings):
            assert len(slots) == plan.num_tokens and len(all_tables[g]) == plan.num_seqs * width
            for slot, token, position in zip(slots, inputs, plan.positions, strict=True):
                assert slot // size != null, "a write into the null block"
                self.kv[slot] = (token, position)
        for i, seq_id in enumerate(plan.seq_ids):
            seq = self.seqs[seq_id]
            length = plan.context_lens[i]
            first_query = length - plan.query_lens[i]
            seq_tables = [seq.block_table, *seq.group_block_tables]
            for g, window in enumerate(self.windows):
                table = all_tables[g][i * width : (i + 1) * width].tolist()
                assert table[: len(seq_tables[g])] == seq_tables[g]
                for t in range(plan.cu_seqlens_q[i], plan.cu_seqlens_q[i + 1]):
                    p = plan.positions[t]
                    assert slot_mappings[g][t] == table[p // size] * size + p % size
                start = 0 if window is None else max(first_query - window + 1, 0)
                seen = [
                    self.kv.get(table[p // size] * size + p % size) for p in range(start, length)
                ]
                expected = [(history[seq_id][p], p) for p in range(start, length)]
                assert seen == expected, f"sequence {seq_id} read stale K/V (window {window})"

    def execute(self, plan: BatchPlan) -> list[int]:
        history = {
            seq_id: self.seqs[seq_id].token_ids[: plan.context_lens[i]]
            for i, seq_id in enumerate(plan.seq_ids)
        }
        self.apply_deltas_and_copies(plan)
        self.write_and_read(plan, plan.input_ids.tolist(), history)
        return self.sample(plan, history)

    def sample(self, plan: BatchPlan, history: dict[int, list[int]]) -> list[int]:
        forks = dict(plan.forks)
        owners = [
            self.parent[seq_id] if j in forks else seq_id
            for j, seq_id in enumerate(plan.sampled_seq_ids)
        ]
        return [
            fake_sample(history[owner], self.salt[seq_id])
            for owner, seq_id in zip(owners, plan.sampled_seq_ids, strict=True)
        ]

    # ------------------------------------------------------------------ invariants
    def holders(self) -> Counter[int]:
        scheduler = self.scheduler
        null = self.allocator.null_block
        holders: Counter[int] = Counter({null: 1})
        for seq in [*scheduler.running, *scheduler.unstarted_forks()]:
            for table in (seq.block_table, *seq.group_block_tables):
                holders.update(block for block in table if block != null)
        holders.update(source for source, _ in scheduler.pending_block_copies)
        return holders

    @invariant()
    def ref_counts_match_block_tables(self) -> None:
        scheduler = self.scheduler
        holders = self.holders()
        for seq in scheduler.waiting:
            assert seq.block_table == [] and seq.group_block_tables == []
        pool = scheduler.pool
        for block_id in range(pool.num_blocks):
            assert pool.block(block_id).ref_count == holders[block_id], block_id
        assert pool.num_free_blocks == sum(1 for b in range(pool.num_blocks) if not holders[b])

    @invariant()
    def running_sequences_hold_exactly_what_they_computed(self) -> None:
        size = self.config.block_size
        null = self.allocator.null_block
        for seq in self.scheduler.running:
            assert seq.num_computed_tokens < seq.num_tokens
            tables = [seq.block_table, *seq.group_block_tables]
            assert len(tables) == len(self.windows)
            assert len({len(table) for table in tables}) == 1, "groups' tables differ in length"
            blocks = cdiv(seq.num_computed_tokens, size)
            for window, table in zip(self.windows, tables, strict=True):
                live = [block for block in table if block != null]
                assert len(set(live)) == len(live)
                if window is None:
                    assert len(live) == len(table)
                if seq.seq_id in self.ahead:
                    assert len(table) >= blocks
                    continue
                if self.steps_in_flight(seq):
                    continue
                # (Async: after a roll-back a decode row may hold its next token's block.)
                assert blocks <= len(table) <= blocks + self.live_slack
                if window is not None:
                    limit = max_live_blocks(window, size) + self.live_slack
                    assert len(live) <= limit, (window, table)
                    if len(live) < len(table):
                        event("a sliding group freed blocks out of its window")

    live_slack = 0

    def steps_in_flight(self, seq: Sequence) -> bool:
        return False

    @invariant()
    def pool_is_all_free_when_idle(self) -> None:
        if not self.scheduler.has_unfinished():
            pool = self.scheduler.pool
            assert pool.num_free_blocks == pool.num_blocks - 1  # the null block


class KVGroupsMachine(GroupsMixin, SchedulerMachine):
    pass


class AsyncKVGroupsMachine(GroupsMixin, AsyncSchedulerMachine):
    live_slack = 1

    def steps_in_flight(self, seq: Sequence) -> bool:
        return any(seq.seq_id in plan.seq_ids for plan, _ in self.flight)

    def execute_with(self, plan: BatchPlan, previous_tokens: list[int] | None) -> list[int]:
        carried = {
            row: previous_tokens[j]  # type: ignore[index]
            for row, j in zip(plan.carried_rows, plan.carried_samples, strict=True)
        }
        inputs = [carried.get(t, token) for t, token in enumerate(plan.input_ids)]
        assert PENDING_TOKEN not in inputs, "a pending input that is not carried"
        history: dict[int, list[int]] = {}
        for i, seq_id in enumerate(plan.seq_ids):
            real = list(self.seqs[seq_id].token_ids)
            if real[-1] == PENDING_TOKEN:  # the token of the plan in flight: carried here
                real[-1] = carried[plan.cu_seqlens_q[i]]
            history[seq_id] = real[: plan.context_lens[i]]
        self.apply_deltas_and_copies(plan)
        self.write_and_read(plan, inputs, history)
        return self.sample(plan, history)


class SpecKVGroupsMachine(GroupsMixin, SpecSchedulerMachine):
    """Speculative decoding across groups: verify rows and lookahead blocks in every group
    (group 0 full: the spec machine's own executor reads the whole context through it)."""

    @initialize(
        **SETUP,
        windows=GROUP_WINDOWS.filter(lambda windows: windows[0] is None),
        k=st.integers(1, 4),
        lookahead=st.sampled_from([0, 0, 3]),
    )
    def setup(  # type: ignore[override]
        self, windows: tuple[int | None, ...], k: int, lookahead: int, **base: Any
    ) -> None:
        SpecSchedulerMachine.setup(self, k=k, lookahead=lookahead, **base)
        self.use_groups(windows)
        size = self.config.block_size
        # A sequence keeps the blocks of its latest verify row and of the lookahead.
        self.live_slack = cdiv(k + lookahead + 1, size) + 1

    def execute(self, plan: BatchPlan) -> list[int]:
        samples = SpecSchedulerMachine.execute(self, plan)
        history = {}
        for i, seq_id in enumerate(plan.seq_ids):
            seq = self.seqs[seq_id]
            history[seq_id] = (seq.token_ids + seq.spec_token_ids)[: plan.context_lens[i]]
        self.write_and_read(plan, plan.input_ids.tolist(), history)
        return samples


# Smaller budgets than the plain machines': these add coverage of the groups, not of the loop.
GROUPED = sized(
    {
        "ci": {"max_examples": 40, "stateful_step_count": 40},
        "quick": {"max_examples": 25, "stateful_step_count": 30},
        "thorough": {"max_examples": 1500, "stateful_step_count": 100},
    }
)
TestKVGroupsMachine = KVGroupsMachine.TestCase
TestKVGroupsMachine.settings = GROUPED
TestAsyncKVGroupsMachine = AsyncKVGroupsMachine.TestCase
TestAsyncKVGroupsMachine.settings = GROUPED
TestSpecKVGroupsMachine = SpecKVGroupsMachine.TestCase
TestSpecKVGroupsMachine.settings = GROUPED
