"""Stateful property test of the Scheduler, driven by a fake executor with a fake KV cache.

The executor stores ``(token, position)`` at every slot a plan writes and, for every sampled
sequence, reads the sequence's whole context back through its block table. The next token
is a hash of what it *read*, so a prefix hit that served the wrong K/V, a write into a
shared block or a lost block would change the output. An oracle that needs no scheduler at
all (apply the sampler to the token history until a finish rule fires) says what every
request must produce, whatever the pool size, token budget, chunking, preemption or
prefix caching did on the way.

The executor also keeps a sampling table fed only by the plans' deltas (released slots, new
requests) and checks that every sampled row's slot names the right request, with the right
sample index. Some plans are abandoned (never postprocessed, as when a step fails), with or
without the executor having applied their deltas. After every rule the scheduler's
incremental state (decode rows, their calendar, slots) must equal a recomputation from the
sequences (``Scheduler.check_integrity``).

Some requests have several completions (``n > 1``): each completion's "model" is salted
differently, so forks diverge at once; the fake KV cache executes the plans' block copies, so
a fork whose copy of the prompt's last block is missing, late or overwritten reads stale K/V.

Both scheduling policies run. Under the mixed policy every plan must give every running
decoding sequence its token (a decode row) unless it was preempted: no decode stalls.
"""

from __future__ import annotations

from array import array
from collections import Counter

import pytest
import xxhash
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedinfer.domain import (
    BatchPlan,
    FinishReason,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
    cdiv,
)
from pagedinfer.errors import InvalidRequestError

VOCAB = 40
EOS = 0
TOKEN = st.integers(1, VOCAB - 1)


def fake_sample(token_ids: list[int], salt: int = 0) -> int:
    """The "model": a deterministic function of the token history (EOS about 1 in 40);
    ``salt`` tells the completions of one request apart."""
    return xxhash.xxh64_intdigest(array("q", token_ids).tobytes(), seed=salt) % VOCAB


def oracle(
    prompt: list[int], params: SamplingParams, max_model_len: int, salt: int = 0
) -> tuple[list[int], FinishReason]:
    """What an unconstrained engine generates: the spec's finish rules, nothing else."""
    tokens = list(prompt)
    while True:
        token = fake_sample(tokens, salt)
        tokens.append(token)
        completion = tokens[len(prompt) :]
        stops = (token == EOS and not params.ignore_eos) or token in params.stop_token_ids
        if stops and len(completion) > params.min_tokens:  # min_tokens hold stops back
            return completion, FinishReason.STOP
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
        if len(completion) >= max_tokens or len(tokens) >= max_model_len:
            return completion, FinishReason.LENGTH


# The settings every machine draws (variants add their own to these).
SETUP = {
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "max_model_len": st.integers(2, 40),
    "spare_blocks": st.integers(0, 4),
    "budget": st.sampled_from([1, 2, 3, 5, 8, 64]),
    "max_num_seqs": st.integers(1, 5),
    "caching": st.booleans(),
    "prefixes": st.lists(st.lists(TOKEN, min_size=1, max_size=40), min_size=1, max_size=3),
    "policy": st.sampled_from(["mixed", "mixed", "prefill_first"]),
}


class SchedulerMachine(RuleBasedStateMachine):
    scheduler: Scheduler

    @initialize(**SETUP)
    def setup(
        self,
        block_size: int,
        max_model_len: int,
        spare_blocks: int,
        budget: int,
        max_num_seqs: int,
        caching: bool,
        prefixes: list[list[int]],
        policy: str,
    ) -> None:
        # The smallest pool the config accepts, plus a few blocks: preemption is common.
        num_blocks = cdiv(max_model_len, block_size) + spare_blocks
        self.config = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_prefix_caching=caching,
            eos_token_ids=frozenset({EOS}),
            scheduling_policy=policy,
        )
        self.scheduler = Scheduler(self.config)
        self.prefixes = prefixes
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (token id, position)
        self.seqs: dict[int, Sequence] = {}
        self.expected: dict[int, tuple[list[int], FinishReason]] = {}
        self.aborted: set[int] = set()  # aborted or finished early by the caller
        self.admitted: list[int] = []  # request ids in order of their first admission
        self.cached_at_admission: dict[int, int] = {}
        self.next_id = 0
        self.salt: dict[int, int] = {}  # request's completion index of each sequence
        self.parent: dict[int, int] = {}  # fork id -> first sequence of its request
        # The executor's sampling table: slot -> (request id, params, prompt length).
        self.table: dict[int, tuple[int, SamplingParams, int]] = {}
        # Requests in a plan that was dropped, since: they may hold blocks for that plan.
        self.ahead: set[int] = set()

    # -------------------------------------------------------------------------- rules
    @rule(
        which=st.integers(0, 2),
        prefix_len=st.integers(0, 40),
        suffix=st.lists(TOKEN, max_size=10),
        max_tokens=st.none() | st.integers(1, 12),
        min_tokens=st.sampled_from([0, 0, 0, 2]),
        ignore_eos=st.booleans(),
        stop_token=st.none() | TOKEN,
        extra_key=st.sampled_from([None, None, None, 0]),
        fit=st.sampled_from([True, True, True, False]),
        n=st.sampled_from([1, 1, 1, 2, 3]),
    )
    def add(
        self,
        which: int,
        prefix_len: int,
        suffix: list[int],
        max_tokens: int | None,
        min_tokens: int,
        ignore_eos: bool,
        stop_token: int | None,
        extra_key: int | None,
        fit: bool,
        n: int,
    ) -> None:
        prompt = self.prefixes[which % len(self.prefixes)][:prefix_len] + suffix
        if fit:  # most requests should be servable; the others test the rejection
            prompt = prompt[: self.config.max_model_len - 1]
        stops = () if stop_token is None else (stop_token,)
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=stops,
        )
        seqs = [Sequence(self.next_id + i, prompt, params, extra_key=extra_key) for i in range(n)]
        seq = seqs[0]
        if (
            not prompt
            or len(prompt) + 1 > self.config.max_model_len
            or n > self.config.max_running
            or (n > 1 and self.fork_blocks(len(prompt), n) > self.config.num_blocks)
        ):
            with pytest.raises(InvalidRequestError):
                self.scheduler.add(seq, forks=seqs[1:])
            assert all(self.scheduler.get(s.seq_id) is None for s in seqs)
            return
        self.scheduler.add(seq, forks=seqs[1:])
        for salt, completion in enumerate(seqs):
            self.seqs[completion.seq_id] = completion
            self.salt[completion.seq_id] = salt
            if salt:
                self.parent[completion.seq_id] = seq.seq_id
            self.expected[completion.seq_id] = oracle(
                prompt, params, self.config.max_model_len, salt
            )
        self.next_id += n
        if n > 1:
            event("a request with several completions")

    def fork_blocks(self, prompt_len: int, n: int) -> int:
        """Blocks a prompt and the copies of its last block for ``n`` completions take."""
        size = self.config.block_size
        return cdiv(prompt_len, size) + (n - 1) * (prompt_len % size != 0)

    @rule(repeat=st.integers(1, 8))
    def step(self, repeat: int) -> None:
        for _ in range(repeat):
            self.one_step()

    @rule(which=st.integers(0, 100), stop_string=st.booleans())
    def abort(self, which: int, stop_string: bool) -> None:
        """The caller aborts, or the engine matched a stop string and finishes the request."""
        seq_id = which % (self.next_id + 1)  # sometimes an id never used
        seq = self.seqs.get(seq_id)
        was_unfinished = seq is not None and not seq.is_finished
        unfinished = [s for s in self.seqs.values() if not s.is_finished]
        if stop_string:
            finished = self.scheduler.finish(seq_id, FinishReason.STOP)
            assert finished is (seq if was_unfinished else None)
        else:
            assert self.scheduler.abort(seq_id) == was_unfinished
        if was_unfinished:
            assert seq is not None and seq.is_finished
            assert seq.finish_reason is (FinishReason.STOP if stop_string else FinishReason.ABORT)
            self.aborted.add(seq_id)
            # Completions that had not forked yet end with the request's first sequence.
            for other in unfinished:
                if other is not seq and other.is_finished:
                    assert self.parent.get(other.seq_id) == seq_id
                    assert other.completion_token_ids == []
                    assert other.finish_reason is seq.finish_reason
                    self.aborted.add(other.seq_id)
            event(f"aborted a {'running' if seq.completion_token_ids else 'fresh'} request")

    @rule(apply_deltas=st.booleans())
    def abandon_a_plan(self, apply_deltas: bool) -> None:
        """A step that fails after schedule(): the plan is never postprocessed; the executor
        may or may not have applied its sampling deltas (and stored some K/V)."""
        plan = self.schedule()
        if plan is None:
            return
        self.check_plan(plan)
        self.record_admissions(plan)
        if apply_deltas:
            self.execute(plan)
        self.ahead.update(plan.seq_ids)
        event("abandoned a plan")

    @rule(dice=st.integers(0, 9))
    def reset_prefix_cache(self, dice: int) -> None:
        if dice == 0:  # rarely, or the cache would rarely hold anything
            self.scheduler.pool.reset_prefix_cache()

    def teardown(self) -> None:
        # Every request still queued must finish, with the oracle's tokens, and leave the
        # pool empty.
        for _ in range(5_000):
            if not self.scheduler.has_unfinished():
                break
            self.one_step()
        assert not self.scheduler.has_unfinished(), "requests left unfinished"
        self.outputs_match_the_oracle()
        self.pool_is_all_free_when_idle()
        if self.scheduler.stats().num_preemptions:
            event("preempted")
        if self.scheduler.pool.stats().prefix_hit_tokens:
            event("prefix cache hit")

    # ------------------------------------------------------------------- the executor
    def schedule(self) -> BatchPlan | None:
        """``Scheduler.schedule``; under the mixed policy, no running decoder is left out."""
        scheduler = self.scheduler
        plan = scheduler.schedule()
        if plan is not None and self.config.scheduling_policy == "mixed":
            decode_rows = set(plan.seq_ids[: plan.num_decode_rows])
            for seq in scheduler.running:
                # Preempted sequences are no longer running: the others all get a token.
                assert not seq.decoding or seq.seq_id in decode_rows, f"{seq!r} stalled"
            if plan.is_mixed:
                event("mixed step")
        return plan

    def one_step(self) -> None:
        scheduler = self.scheduler
        plan = self.schedule()
        if plan is None:
            # The scheduler owns the whole pool, so something can always run.
            assert not scheduler.has_unfinished(), "nothing scheduled with requests pending"
            return
        self.check_plan(plan)
        sampled = self.execute(plan)
        before = {seq_id: self.seqs[seq_id].num_tokens for seq_id in plan.sampled_seq_ids}
        self.record_admissions(plan)
        updated = scheduler.postprocess(plan, sampled)
        self.ahead.difference_update(plan.seq_ids)
        assert [seq.seq_id for seq in updated] == plan.sampled_seq_ids
        for seq in updated:
            assert seq.num_tokens == before[seq.seq_id] + 1
        if plan.num_seqs > 1 and plan.is_prefill:
            event("multi-sequence prefill")
        if plan.forks:
            event("forked completions")
        if plan.block_copies:
            event("copied a block for a fork")
        if plan.is_prefill and plan.has_cached_prefix:
            event("prefill with cached context (chunk or prefix hit)")

    def record_admissions(self, plan: BatchPlan) -> None:
        for seq_id in plan.seq_ids:
            if seq_id not in self.admitted and seq_id not in self.parent:  # forks: not admitted
                self.admitted.append(seq_id)
                self.cached_at_admission[seq_id] = self.seqs[seq_id].num_cached_tokens

    def apply_deltas_and_copies(self, plan: BatchPlan) -> None:
        """The executor's first work on a plan: the sampling table's deltas (releases, then
        new requests), then the block copies (before the step's writes)."""
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

    def execute(self, plan: BatchPlan) -> list[int]:
        size = plan.block_size
        self.apply_deltas_and_copies(plan)
        for j, seq_id in enumerate(plan.sampled_seq_ids):
            owner, params, prompt_len = self.table[plan.sample_slots[j]]
            seq = self.seqs[seq_id]
            assert (owner, params, prompt_len) == (seq_id, seq.params, seq.num_prompt_tokens)
            step = plan.positions[plan.sample_indices[j]] + 1 - prompt_len
            assert step == seq.num_completion_tokens, "the derived sample index is wrong"
        for slot, token, position in zip(
            plan.slot_mapping, plan.input_ids, plan.positions, strict=True
        ):
            self.kv[slot] = (token, position)
        sampled: dict[int, int] = {}
        for i, seq_id in enumerate(plan.seq_ids):
            table = plan.block_table(i)
            seen = [
                self.kv.get(table[p // size] * size + p % size) for p in range(plan.context_lens[i])
            ]
            expected = [(token, p) for p, token in enumerate(self.seqs[seq_id].token_ids)]
            assert seen == expected[: plan.context_lens[i]], f"sequence {seq_id} read stale K/V"
            sampled[seq_id] = [token for token, _ in expected[: plan.context_lens[i]]]
        # A fork samples from its parent's row, with its own salt.
        forks = dict(plan.forks)
        owners = [
            self.parent[seq_id] if j in forks else seq_id
            for j, seq_id in enumerate(plan.sampled_seq_ids)
        ]
        return [
            fake_sample(sampled[owner], self.salt[seq_id])
            for owner, seq_id in zip(owners, plan.sampled_seq_ids, strict=True)
        ]

    def check_plan(self, plan: BatchPlan) -> None:
        config = self.config
        size = config.block_size
        assert plan.block_size == size
        assert 1 <= plan.num_tokens <= config.max_num_batched_tokens
        assert 1 <= plan.num_seqs <= config.max_num_seqs
        assert len(set(plan.seq_ids)) == plan.num_seqs
        num_decode = plan.num_decode_rows
        if not plan.is_prefill:
            assert num_decode == plan.num_seqs
        if self.config.scheduling_policy == "prefill_first":
            assert num_decode in (0, plan.num_seqs), "prefill_first never mixes"
        assert plan.query_lens[:num_decode].tolist() == [1] * num_decode, "one token per row"
        assert plan.sample_indices[:num_decode].tolist() == list(range(num_decode))
        for row, seq_id in enumerate(plan.seq_ids):
            # Decode rows first: running decoding sequences; then chunks of the others.
            assert self.seqs[seq_id].decoding == (row < num_decode)
        cu_q = [0]
        cu_k = [0]
        for q, k in zip(plan.query_lens, plan.context_lens, strict=True):
            assert q >= 1
            cu_q.append(cu_q[-1] + q)
            cu_k.append(cu_k[-1] + k)
        assert plan.cu_seqlens_q.tolist() == cu_q and plan.cu_seqlens_k.tolist() == cu_k
        assert len(plan.input_ids) == len(plan.positions) == len(plan.slot_mapping) == cu_q[-1]
        assert plan.max_seqlen_q == max(plan.query_lens)
        assert plan.max_seqlen_k == max(plan.context_lens)
        widest = max(len(self.seqs[seq_id].block_table) for seq_id in plan.seq_ids)
        assert plan.block_table_width == widest
        assert len(plan.block_tables) == plan.num_seqs * widest
        for name in ("seq_ids", "input_ids", "positions", "slot_mapping", "sample_indices"):
            assert getattr(plan, name).typecode == "q", name
        for name in ("query_lens", "context_lens", "cu_seqlens_q", "cu_seqlens_k"):
            assert getattr(plan, name).typecode == "i", name
        assert plan.block_tables.typecode == plan.sample_slots.typecode == "i"
        sampled = []
        written_blocks: set[int] = set()
        for i, seq_id in enumerate(plan.seq_ids):
            seq = self.seqs[seq_id]
            assert seq.status is SequenceStatus.RUNNING
            start = seq.num_computed_tokens
            end = start + plan.query_lens[i]
            assert plan.context_lens[i] == end <= seq.num_tokens
            rows = slice(cu_q[i], cu_q[i + 1])
            assert plan.positions[rows].tolist() == list(range(start, end))
            assert plan.input_ids[rows].tolist() == seq.token_ids[start:end]
            table = plan.block_table(i)
            assert table[: len(seq.block_table)] == seq.block_table
            assert len(seq.block_table) >= cdiv(end, size)
            for position, slot in zip(range(start, end), plan.slot_mapping[rows], strict=True):
                block_id = seq.block_table[position // size]
                assert slot == block_id * size + position % size, "slot outside own blocks"
                written_blocks.add(block_id)
            if end == seq.num_tokens:
                sampled.append((seq_id, cu_q[i + 1] - 1))
        assert len(set(plan.slot_mapping)) == len(plan.slot_mapping), "two tokens, one slot"
        pool = self.scheduler.pool
        # The only other holders of a block written now: forks sampled from this very step
        # (they read it afterwards) and pins of block copies (their source is read first).
        fork_ids = {seq_id for _, seq_id in plan.forks}
        sharers = Counter(b for f in fork_ids for b in self.seqs[f].block_table)
        sharers.update(source for source, _ in self.scheduler.pending_block_copies)
        for block_id in written_blocks:
            block = pool.block(block_id)
            assert block.ref_count == 1 + sharers[block_id], f"write into shared {block!r}"
            assert block.hash is None, f"write into cached {block!r}"
        forks = dict(plan.forks)
        assert all(self.parent[seq_id] in plan.seq_ids for seq_id in forks.values())
        own = [seq_id for j, seq_id in enumerate(plan.sampled_seq_ids) if j not in forks]
        assert own == [s for s, _ in sampled]
        rows = [r for j, r in enumerate(plan.sample_indices) if j not in forks]
        assert rows == [r for _, r in sampled]
        for j, seq_id in forks.items():  # a fork samples its parent's last row
            parent_entry = plan.sampled_seq_ids.index(self.parent[seq_id])
            assert plan.sample_indices[j] == plan.sample_indices[parent_entry]
            assert self.seqs[seq_id].num_completion_tokens == 0
        assert plan.sample_slots.tolist() == [self.seqs[s].slot for s in plan.sampled_seq_ids]
        assert len(set(plan.sample_slots)) == plan.num_samples
        if not plan.is_prefill:
            assert plan.sample_indices.tolist() == list(range(plan.num_seqs))

    # --------------------------------------------------------------------- invariants
    @invariant()
    def pool_integrity(self) -> None:
        self.scheduler.pool.check_integrity()

    @invariant()
    def incremental_state_matches_a_recomputation(self) -> None:
        # Decode rows (slots, positions, tables...), their calendar, phases, sampling slots.
        self.scheduler.check_integrity()
        for seq in self.seqs.values():
            if seq.is_finished:
                assert seq.slot == -1 and not seq.decoding

    @invariant()
    def ref_counts_match_block_tables(self) -> None:
        scheduler = self.scheduler
        holders = Counter(b for seq in scheduler.running for b in seq.block_table)
        # Forks of a plan in flight hold their blocks already; copy sources are pinned.
        holders.update(b for seq in scheduler.unstarted_forks() for b in seq.block_table)
        holders.update(source for source, _ in scheduler.pending_block_copies)
        for seq in scheduler.waiting:
            assert seq.block_table == [] and seq.status is SequenceStatus.WAITING
            assert seq.num_computed_tokens == 0
        pool = scheduler.pool
        for block_id in range(pool.num_blocks):
            assert pool.block(block_id).ref_count == holders[block_id]
        assert pool.num_free_blocks == sum(1 for b in range(pool.num_blocks) if not holders[b])

    @invariant()
    def running_sequences_hold_exactly_what_they_computed(self) -> None:
        scheduler = self.scheduler
        assert len(scheduler.running) <= min(
            self.config.max_num_seqs, self.config.max_num_batched_tokens
        )
        size = self.config.block_size
        for seq in scheduler.running:
            assert seq.status is SequenceStatus.RUNNING
            assert seq.num_computed_tokens < seq.num_tokens
            blocks = cdiv(seq.num_computed_tokens, size)
            if seq.seq_id in self.ahead:  # it keeps the blocks of a dropped plan's step
                assert len(seq.block_table) >= blocks
            else:
                assert len(seq.block_table) == blocks
                # A request's last prompt token forks in a prefill step: it never decodes.
                forks_pending = bool(scheduler.unstarted_forks(seq.seq_id))
                last_one = seq.num_computed_tokens == seq.num_tokens - 1
                assert seq.decoding == (last_one and not forks_pending)
            assert len(set(seq.block_table)) == len(seq.block_table)

    @invariant()
    def queues_hold_exactly_the_unfinished(self) -> None:
        scheduler = self.scheduler
        queued = [
            seq.seq_id
            for seq in [*scheduler.waiting, *scheduler.running, *scheduler.unstarted_forks()]
        ]
        unfinished = [i for i, seq in self.seqs.items() if not seq.is_finished]
        assert sorted(queued) == sorted(unfinished)
        assert scheduler.num_unfinished == len(unfinished)

    @invariant()
    def cached_tokens_are_prompt_tokens_found_at_first_admission(self) -> None:
        for seq_id, seq in self.seqs.items():
            # At least one prompt token is always computed, whatever the cache holds.
            assert seq.num_cached_tokens < seq.num_prompt_tokens
            if seq_id in self.cached_at_admission:
                assert seq.num_cached_tokens == self.cached_at_admission[seq_id]
            if not self.config.enable_prefix_caching:
                assert seq.num_cached_tokens == 0

    @invariant()
    def first_come_first_served(self) -> None:
        # Preempted requests go back to the front, but new ones are admitted in arrival order.
        assert self.admitted == sorted(self.admitted)

    @invariant()
    def outputs_match_the_oracle(self) -> None:
        for seq_id, seq in self.seqs.items():
            completion, reason = self.expected[seq_id]
            got = seq.completion_token_ids
            assert got == completion[: len(got)], f"request {seq_id} diverged from the oracle"
            if seq.is_finished and seq_id not in self.aborted:
                assert (got, seq.finish_reason) == (completion, reason)

    @invariant()
    def pool_is_all_free_when_idle(self) -> None:
        if not self.scheduler.has_unfinished():
            pool = self.scheduler.pool
            assert pool.num_free_blocks == pool.num_blocks


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings.get_profile("pagedinfer-property")
