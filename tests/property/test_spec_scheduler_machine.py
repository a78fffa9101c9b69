"""The scheduler state machine with speculative decoding: drafts, verify rows, acceptance.

The machine of ``test_scheduler_machine.py`` (fake KV cache, oracle, rules: add, abort, stop
strings, abandoned plans, prefix-cache resets, small pools that preempt) with
``num_speculative_tokens`` = k in 1..5. After every step a proposer gives each running
sequence drafts: a prefix of the oracle's true continuation followed by wrong tokens, of every
length from none to k, so every accept length occurs. The fake executor samples a verify row
at every position from the sequence's last token on, reading the whole context (drafts
included) back through the fake KV cache, so a draft's K/V in the wrong slot, or a rejected
draft's K/V read as history later, changes the outputs. The oracle knows nothing of
speculation: every request must still produce exactly its tokens and finish reason (stop
tokens and ``max_tokens`` landing inside an accepted run included), the prefix cache must only
ever hold verified tokens, and the pool must be free when idle.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from pagedinfer.domain import BatchPlan, Scheduler, SequenceStatus, cdiv

from .profiles import sized
from .test_scheduler_machine import SETUP, SchedulerMachine, fake_sample


class SpecSchedulerMachine(SchedulerMachine):
    @initialize(**SETUP, k=st.integers(1, 5), lookahead=st.sampled_from([0, 0, 3]))
    def setup(self, k: int, lookahead: int, **base: Any) -> None:  # type: ignore[override]
        SchedulerMachine.setup(self, **base)
        self.config = dataclasses.replace(
            self.config, num_speculative_tokens=k, num_lookahead_tokens=lookahead
        )
        self.scheduler = Scheduler(self.config)
        self.k = k

    def one_step(self) -> None:  # the engine's step, with a proposer after postprocess
        scheduler = self.scheduler
        plan = self.schedule()
        if plan is None:
            assert not scheduler.has_unfinished(), "nothing scheduled with requests pending"
            return
        self.check_plan(plan)
        sampled = self.execute(plan)
        self.record_admissions(plan)
        updated = scheduler.postprocess(plan, sampled)
        self.ahead.difference_update(plan.seq_ids)
        assert [seq.seq_id for seq in updated] == list(dict.fromkeys(plan.sampled_seq_ids))
        if plan.verify_rows:
            event("verify rows")
        for seq in updated:
            if seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1:
                drafts = self.propose(seq.seq_id)
                kept = scheduler.set_drafts(seq.seq_id, drafts)
                assert kept <= min(len(drafts), self.k)

    def propose(self, seq_id: int) -> list[int]:
        """A prefix of the oracle's continuation (0..k tokens right), then wrong tokens."""
        seq = self.seqs[seq_id]
        expected = self.expected[seq_id][0]
        done = seq.num_completion_tokens
        rng = random.Random(seq_id * 1009 + done)
        right = rng.randint(0, self.k)
        drafts = list(expected[done : done + right])
        while len(drafts) < rng.randint(len(drafts), self.k):
            truth = expected[done + len(drafts)] if done + len(drafts) < len(expected) else 0
            drafts.append((truth + rng.randint(1, 5)) % 40)
        return drafts

    def execute(self, plan: BatchPlan) -> list[int]:
        if not plan.verify_rows:
            return super().execute(plan)
        size = plan.block_size
        self.apply_deltas_and_copies(plan)
        for slot, token, position in zip(
            plan.slot_mapping, plan.input_ids, plan.positions, strict=True
        ):
            self.kv[slot] = (token, position)
        samples: list[int] = []
        for j, seq_id in enumerate(plan.sampled_seq_ids):
            owner, params, _ = self.table[plan.sample_slots[j]]
            assert (owner, params) == (seq_id, self.seqs[seq_id].params)
        forks = dict(plan.forks)
        verify = {row: (first, count) for row, first, count in plan.verify_rows}
        for i, seq_id in enumerate(plan.seq_ids):
            seq = self.seqs[seq_id]
            table = plan.block_table(i)
            context = plan.context_lens[i]
            seen = [self.kv.get(table[p // size] * size + p % size) for p in range(context)]
            full = seq.token_ids + seq.spec_token_ids
            assert seen == [(t, p) for p, t in enumerate(full[:context])], "stale K/V"
            if i in verify:
                first, count = verify[i]
                assert len(samples) == first
                assert context - (seq.num_tokens - 1) == count + 1
                for position in range(seq.num_tokens - 1, context):
                    samples.append(fake_sample(full[: position + 1], self.salt[seq_id]))
                    # The sample index seeded sampling keys on: as without speculation.
                    index = plan.positions[plan.sample_indices[len(samples) - 1]] + 1
                    assert index - seq.num_prompt_tokens == position + 1 - seq.num_prompt_tokens
            elif context == seq.num_tokens:
                samples.append(fake_sample(full[:context], self.salt[seq_id]))
                for j, fork_id in forks.items():
                    if self.parent[fork_id] == seq_id:
                        samples.append(fake_sample(full[:context], self.salt[fork_id]))
                        assert j == len(samples) - 1
        assert len(samples) == plan.num_samples
        return samples

    def check_plan(self, plan: BatchPlan) -> None:
        config = self.config
        size = config.block_size
        assert 1 <= plan.num_tokens <= config.max_num_batched_tokens
        assert plan.num_decode_rows == 0, "speculating, every row is a chunk"
        for row, first, count in plan.verify_rows:
            seq = self.seqs[plan.seq_ids[row]]
            assert 1 <= count <= len(seq.spec_token_ids) <= self.k
            end = plan.cu_seqlens_q[row + 1]
            assert plan.input_ids[end - count : end].tolist() == seq.spec_token_ids[:count]
            assert plan.sample_indices[first : first + count + 1].tolist() == list(
                range(end - count - 1, end)
            )
            assert plan.context_lens[row] == seq.num_tokens + count <= config.max_model_len
            event(f"verify row with {count} drafts")
        for i, seq_id in enumerate(plan.seq_ids):
            seq = self.seqs[seq_id]
            start = seq.num_computed_tokens
            end = start + plan.query_lens[i]
            assert plan.context_lens[i] == end
            assert len(seq.block_table) >= cdiv(end, size)
            rows = slice(plan.cu_seqlens_q[i], plan.cu_seqlens_q[i + 1])
            for position, slot in zip(range(start, end), plan.slot_mapping[rows], strict=True):
                assert slot == seq.block_table[position // size] * size + position % size
            for block_id in {seq.block_table[p // size] for p in range(start, end)}:
                assert self.scheduler.pool.block(block_id).hash is None, "write into cached"
        assert len(set(plan.slot_mapping)) == len(plan.slot_mapping), "two tokens, one slot"

    @invariant()
    def running_sequences_hold_exactly_what_they_computed(self) -> None:
        # Speculating, a sequence keeps the blocks of its latest verify row (rejected drafts'
        # slots are overwritten by its next tokens) and of the lookahead: bounded by those.
        size = self.config.block_size
        reach = self.k + self.config.num_lookahead_tokens + 1
        for seq in self.scheduler.running:
            assert seq.num_computed_tokens < seq.num_tokens
            assert not seq.decoding
            assert cdiv(seq.num_computed_tokens, size) <= len(seq.block_table)
            if seq.seq_id not in self.ahead:
                limit = cdiv(max(seq.num_tokens, seq.num_computed_tokens + reach), size)
                assert len(seq.block_table) <= max(limit, cdiv(seq.num_tokens, size))


TestSpecSchedulerMachine = SpecSchedulerMachine.TestCase
TestSpecSchedulerMachine.settings = sized(
    {
        "ci": {"max_examples": 150, "stateful_step_count": 40},
        "quick": {"max_examples": 15, "stateful_step_count": 20},
        "thorough": {"max_examples": 1500, "stateful_step_count": 80},
    }
)
