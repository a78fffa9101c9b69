"""The scheduler state machine with one step in flight (async scheduling).

The machine of ``test_scheduler_machine.py`` (same fake KV cache, oracle, invariants and
rules: add, abort, stop strings, prefix-cache resets) drives the scheduler the way the async
engine does: ``schedule()``, then ``schedule_ahead()`` for step N+1 *before*
``postprocess(N)``, so that every postprocess arrives after the next plan was made. Plans
are executed when they are launched; a plan made ahead gets the inputs of its carried rows
from the previous plan's samples (as the device does), and reads its context through the
fake KV cache, so a carried token in the wrong row, or a speculative row that wrote over
someone's K/V, changes the outputs. Rules fire between any two of these calls: aborts and
stop strings between ``schedule_ahead`` and ``postprocess``, preemption inside
``schedule_ahead`` (small pools), and failures of the steps in flight (their sequences
aborted, as the engine does, then ``schedule()`` again, which rolls both plans back).
The oracle then says that no request emitted a token past its end and that every finished
one has exactly its tokens.
"""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from pagedinfer.domain import BatchPlan, Sequence, SequenceStatus, cdiv
from pagedinfer.domain.plan import PENDING_TOKEN

from .test_scheduler_machine import SchedulerMachine, fake_sample


class AsyncSchedulerMachine(SchedulerMachine):
    def __init__(self) -> None:
        super().__init__()
        # Plans launched and not postprocessed, oldest first, with their sampled tokens
        # (the fake executor runs a plan when it is launched). At most two; with two, the
        # older was moved on by schedule_ahead (so is a single one after schedule_ahead
        # returned None: `advanced`).
        self.flight: list[tuple[BatchPlan, list[int]]] = []
        self.advanced = False
        # Prefill chunks of dropped plans: sequence -> (its preemptions then, the blocks up
        # to the chunk's end). The roll-back keeps them for the chunk planned again, which
        # may be shorter (decode rows joined meanwhile take some of the budget): then the
        # sequence holds them past a record, until its next chunk uses them.
        self.kept: dict[int, tuple[int, int]] = {}

    # ---------------------------------------------------------------------- rules
    def one_step(self) -> None:
        """Launch the next plan (ahead of the one in flight, when there is one), then
        postprocess the oldest plan in flight: the async engine's step, which leaves one
        plan in flight."""
        if not self.flight:
            self.launch()
        self.launch()
        if self.flight:
            self.record()

    @rule()
    def launch_only(self) -> None:
        """Plan (and run) the next step, leaving the postprocess for later rules."""
        self.launch()

    @rule()
    def record_only(self) -> None:
        if self.flight:
            self.record()

    @rule(run_the_new_plan=st.booleans())
    def abandon_a_plan(self, run_the_new_plan: bool) -> None:
        """Every step in flight fails: ``schedule()`` rolls them back and plans again; that
        plan runs, or fails too before it ran (the next call plans it again)."""
        if not self.flight:
            return
        size = self.config.block_size
        for plan, _ in self.flight:
            self.ahead.update(plan.seq_ids)
            for i in range(plan.num_decode_rows, plan.num_seqs):
                chunk_seq = self.seqs[plan.seq_ids[i]]
                held = cdiv(plan.context_lens[i], size)
                self.kept[chunk_seq.seq_id] = (chunk_seq.num_preemptions, held)
        if len(self.flight) == 2 or self.advanced:
            # The contract (Scheduler.schedule_ahead): a plan moved on by schedule_ahead()
            # failed, so did the plan made ahead of its tokens; the sequences of both end
            # (the engine aborts their requests) before schedule() rolls back.
            for plan, _ in self.flight:
                for seq_id in {*plan.seq_ids, *plan.sampled_seq_ids}:
                    seq = self.seqs.get(seq_id)
                    if seq is not None and not seq.is_finished:
                        self.abort(which=seq_id, stop_string=False)
        event(f"rolled back {len(self.flight)} plans in flight")
        self.flight = []
        self.advanced = False
        plan = self.scheduler.schedule()
        if plan is None:
            return
        self.check_plan(plan)
        self.record_admissions(plan)
        if run_the_new_plan:
            self.flight.append((plan, self.execute_with(plan, None)))
        else:
            self.ahead.update(plan.seq_ids)

    def teardown(self) -> None:
        while self.flight:
            self.record()
        super().teardown()
        while self.flight:
            self.record()

    # ------------------------------------------------------------------- the driver
    def launch(self) -> None:
        scheduler = self.scheduler
        if self.advanced or len(self.flight) == 2:
            return  # the older plan in flight must be postprocessed first
        if not self.flight:
            plan = self.schedule()
            if plan is None:
                assert not scheduler.has_unfinished(), "nothing scheduled with requests pending"
                return
            self.check_plan(plan)
            self.record_admissions(plan)
            self.flight.append((plan, self.execute_with(plan, None)))
            return
        previous, previous_tokens = self.flight[0]
        plan = scheduler.schedule_ahead()
        if plan is None:
            self.advanced = True
            event("nothing to plan ahead")
            return
        self.check_plan(plan)
        self.check_carried(plan, previous)
        self.record_admissions(plan)
        self.flight.append((plan, self.execute_with(plan, previous_tokens)))
        if plan.carried_rows:
            event("carried tokens")
            if list(plan.carried_rows) != list(range(len(plan.carried_rows))):
                event("carried tokens not a prefix")

    def record(self) -> None:
        plan, tokens = self.flight.pop(0)
        self.advanced = False
        sampled = plan.sampled_seq_ids
        before = {
            seq_id: self.real_tokens(self.seqs[seq_id]) for seq_id in sampled if seq_id in self.seqs
        }
        alive = {seq_id for seq_id in sampled if not self.seqs[seq_id].is_finished}
        updated = self.scheduler.postprocess(plan, tokens)
        self.ahead.difference_update(plan.seq_ids)
        # The sequences that get a token are those of the plan not finished meanwhile.
        assert [seq.seq_id for seq in updated] == [s for s in sampled if s in alive]
        for seq in updated:
            assert seq.token_ids[-1] != PENDING_TOKEN
            assert len(self.real_tokens(seq)) == len(before[seq.seq_id]) + 1
        for seq_id in sampled:
            if seq_id not in alive:
                event("discarded a speculative row")

    # ---------------------------------------------------------------- the executor
    @staticmethod
    def real_tokens(seq: Sequence) -> list[int]:
        tokens = seq.token_ids
        return tokens[:-1] if tokens and tokens[-1] == PENDING_TOKEN else list(tokens)

    def execute_with(self, plan: BatchPlan, previous_tokens: list[int] | None) -> list[int]:
        """The fake executor of the base machine, with the carried rows' inputs taken from
        the previous plan's samples."""
        carried = {
            row: previous_tokens[j]  # type: ignore[index]
            for row, j in zip(plan.carried_rows, plan.carried_samples, strict=True)
        }
        assert previous_tokens is not None or not carried
        inputs = [carried.get(t, token) for t, token in enumerate(plan.input_ids)]
        assert PENDING_TOKEN not in inputs, "a pending input that is not carried"
        size = plan.block_size
        for slot_id in plan.released_slots:
            self.table.pop(slot_id, None)
        for request in plan.new_requests:
            self.table[request.slot] = (request.seq_id, request.params, request.num_prompt_tokens)
        for source, target in plan.block_copies:
            for offset in range(size):
                entry = self.kv.get(source * size + offset)
                if entry is None:
                    self.kv.pop(target * size + offset, None)
                else:
                    self.kv[target * size + offset] = entry
        for slot, token, position in zip(plan.slot_mapping, inputs, plan.positions, strict=True):
            self.kv[slot] = (token, position)
        history: dict[int, list[int]] = {}
        for i, seq_id in enumerate(plan.seq_ids):
            seq = self.seqs[seq_id]
            real = list(seq.token_ids)
            if real[-1] == PENDING_TOKEN:  # the token of the plan in flight: carried here
                real[-1] = carried[plan.cu_seqlens_q[i]]
            table = plan.block_table(i)
            length = plan.context_lens[i]
            seen = [self.kv.get(table[p // size] * size + p % size) for p in range(length)]
            expected = [(token, p) for p, token in enumerate(real[:length])]
            assert seen == expected, f"sequence {seq_id} read stale K/V"
            history[seq_id] = real[:length]
        for j, seq_id in enumerate(plan.sampled_seq_ids):
            owner, _params, prompt_len = self.table[plan.sample_slots[j]]
            assert owner == seq_id and prompt_len == self.seqs[seq_id].num_prompt_tokens
        forks = dict(plan.forks)
        owners = [
            self.parent[seq_id] if j in forks else seq_id
            for j, seq_id in enumerate(plan.sampled_seq_ids)
        ]
        return [
            fake_sample(history[owner], self.salt[seq_id])
            for owner, seq_id in zip(owners, plan.sampled_seq_ids, strict=True)
        ]

    def check_carried(self, plan: BatchPlan, previous: BatchPlan) -> None:
        """Carried rows are exactly the pending inputs; each names its own sample."""
        assert plan.step_id == previous.step_id + 1
        pending = [t for t, token in enumerate(plan.input_ids) if token == PENDING_TOKEN]
        assert list(plan.carried_rows) == pending
        assert all(row < plan.num_decode_rows for row in pending), "only decode rows carry"
        sampled = previous.sampled_seq_ids
        for row, j in zip(plan.carried_rows, plan.carried_samples, strict=True):
            assert sampled[j] == plan.seq_ids[row], "a carried token of another sequence"

    # ----------------------------------------------------------------- invariants
    @invariant()
    def running_sequences_hold_exactly_what_they_computed(self) -> None:
        scheduler = self.scheduler
        in_flight = {seq_id for plan, _ in self.flight for seq_id in plan.seq_ids}
        size = self.config.block_size
        for seq in scheduler.running:
            assert seq.status is SequenceStatus.RUNNING
            assert seq.num_computed_tokens < seq.num_tokens
            blocks = cdiv(seq.num_computed_tokens, size)
            if seq.seq_id in self.ahead or seq.seq_id in in_flight:
                assert len(seq.block_table) >= blocks
            elif seq.decoding:
                # After a roll-back a decode row may already hold the block of its next
                # token (given for a step that never ran), never more.
                assert blocks <= len(seq.block_table) <= seq.num_computed_tokens // size + 1
            else:
                # A chunk planned again shorter than the dropped one leaves the blocks up to
                # the dropped chunk's end (prompt tokens: its next chunks write them).
                preemptions, held = self.kept.get(seq.seq_id, (-1, 0))
                if preemptions == seq.num_preemptions and held > blocks:
                    assert blocks <= len(seq.block_table) <= held
                    assert held <= cdiv(seq.num_tokens, size)
                    event("kept the blocks of a dropped chunk past a record")
                else:
                    assert len(seq.block_table) == blocks
            assert len(set(seq.block_table)) == len(seq.block_table)
        for seq in self.seqs.values():
            pending = seq.token_ids.count(PENDING_TOKEN)
            assert pending <= 1 and (not pending or seq.token_ids[-1] == PENDING_TOKEN)
            if pending:  # only while the plan it was sampled in runs, moved on
                assert self.flight and any(
                    seq.seq_id in plan.seq_ids[: plan.num_decode_rows] for plan, _ in self.flight
                )
                assert not seq.is_finished

    @invariant()
    def outputs_match_the_oracle(self) -> None:
        for seq_id, seq in self.seqs.items():
            completion, reason = self.expected[seq_id]
            got = self.real_tokens(seq)[seq.num_prompt_tokens :]
            assert got == completion[: len(got)], f"request {seq_id} diverged from the oracle"
            if seq.is_finished:
                assert PENDING_TOKEN not in seq.token_ids, "a finished request kept a token"
                if seq_id not in self.aborted:
                    assert (got, seq.finish_reason) == (completion, reason)


TestAsyncSchedulerMachine = AsyncSchedulerMachine.TestCase
TestAsyncSchedulerMachine.settings = settings.get_profile("pagedinfer-property")
