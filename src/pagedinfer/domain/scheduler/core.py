"""The scheduler's loop: queues, ``schedule``, the two policies, ``postprocess``, preemption
and ``finish`` (the package docstring, :mod:`pagedinfer.domain.scheduler`, tells the story;
the modules beside this one answer the loop's narrow questions)."""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from typing import TypedDict

from pagedinfer.domain.block_pool import BlockPool
from pagedinfer.domain.events import (
    PrefixCacheHit,
    SchedulerEvent,
    SequenceFinished,
    SequencePreempted,
)
from pagedinfer.domain.plan import (
    PENDING_TOKEN,
    BatchPlan,
    NewRequest,
    ScheduledChunk,
    build_batch_plan,
    mixed_batch_plan,
)
from pagedinfer.domain.scheduler.adapter_limit import AdapterLimit, running_adapters
from pagedinfer.domain.scheduler.ahead import restore_chunks
from pagedinfer.domain.scheduler.allocator import BlockAllocator
from pagedinfer.domain.scheduler.config import SchedulerConfig, SchedulerStats
from pagedinfer.domain.scheduler.fork_table import ForkTable, check_new_forks
from pagedinfer.domain.scheduler.group_allocator import GroupedBlockAllocator, KVGroupUsage
from pagedinfer.domain.scheduler.prefill import PrefillPlanner, computed_only_at_admission
from pagedinfer.domain.scheduler.rows import DecodeRows
from pagedinfer.domain.scheduler.slots import SlotTable
from pagedinfer.domain.scheduler.stop_rules import StopRules
from pagedinfer.domain.scheduler.tier import HostTierViews, host_tier_link
from pagedinfer.domain.scheduler.verify import VerifyStats, decoding_policy, verified_rows
from pagedinfer.domain.sequence import FinishReason, Sequence, SequenceStatus
from pagedinfer.errors import ConfigurationError, InvalidRequestError

__all__ = ["Scheduler"]


class _Header(TypedDict):
    released_slots: tuple[int, ...]
    new_requests: tuple[NewRequest, ...]
    block_copies: tuple[tuple[int, int], ...]
    step_id: int
    recorded_step_id: int
    made_ahead: bool
    carried_rows: array[int]
    carried_samples: array[int]


class Scheduler(HostTierViews):
    """Turns queued sequences into :class:`BatchPlan` s and sampled tokens into progress.

    Call :meth:`schedule` for a plan, run it, then hand the sampled token ids (one per
    sampled row, in ``plan.sample_indices`` order) to :meth:`postprocess`. A plan that is
    never postprocessed (its step failed) is simply planned again by the next
    :meth:`schedule`; the same plan may also be run again and then postprocessed. The
    executor's side of this contract, the two ways to recover from a failed step and when a
    plan counts as recorded: :mod:`pagedinfer.domain.executor`.

    **Threads.** A scheduler is not thread-safe: call its methods from one thread at a time
    (the engine holds a lock around every call). Only the executor's work on a plan may
    overlap with other calls (``abort`` included; a plan is never modified after
    :meth:`schedule` returns it).

    **What is read-only.** ``running`` and ``waiting`` are copies (changing them changes
    nothing). A queued :class:`Sequence` belongs to the scheduler until it finishes: read
    its fields, never assign them (``status``, ``block_table``, ``slot``,
    ``num_computed_tokens``, ``token_ids``...). ``config`` and ``pool`` are shared, not copied:
    use ``pool`` for its statistics and ``reset_prefix_cache()`` only.

    **Events.** With ``record_events=True`` the scheduler records preemptions, prefix-cache
    hits and every finish (aborts and completions cancelled with their request included) as
    :mod:`~pagedinfer.domain.events`, which :meth:`drain_events` hands over; the caller must
    drain them (they are kept until then). Without it nothing is recorded.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool | None = None,
        *,
        record_events: bool = False,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = pool or BlockPool(
            config.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        if self.pool.block_size != config.block_size or self.pool.num_blocks != config.num_blocks:
            raise ConfigurationError("the block pool does not match the scheduler config")
        # Host KV tier (scheduler/tier.py): evicted blocks copied out, found, copied back in.
        self._tier = host_tier_link(config, self.pool)
        self._allocator = (
            BlockAllocator(self.pool, self._tier)
            if config.is_plain
            else GroupedBlockAllocator(self.pool, config.kv_groups)
        )
        self._num_groups = self._allocator.num_groups
        self._stops = StopRules(config.eos_token_ids, config.max_model_len)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # in admission order: preemption takes the newest
        self._seqs: dict[int, Sequence] = {}
        # Running sequences by phase: prefilling (in running order) or decoding (the rows).
        self._prefilling: list[Sequence] = []
        self._rows = DecodeRows(self._allocator, self._stops)
        self._slots = SlotTable()  # and their deltas not yet confirmed by a postprocess
        self._forks = ForkTable(self.pool, self._allocator)  # n > 1: completions not started
        self._prefill = PrefillPlanner(config, self._allocator, self._forks, self._slots)
        # Speculative decoding on or off: how a sequence goes on once its prompt is computed.
        self._policy = decoding_policy(config.num_speculative_tokens)
        self._verify = VerifyStats(config.num_speculative_tokens)
        self._in_flight: BatchPlan | None = None
        # Async scheduling (schedule_ahead): the plan whose step still runs while the next
        # one was planned, its state moved on as if every sequence in it continued
        # (_move_on), and what its record (_record) or a roll-back needs.
        self._ahead: BatchPlan | None = None
        self._awaiting: set[int] = set()  # its prefill chunks that sample: wait for it
        self._advanced_chunks: list[tuple[Sequence, int, int]] = []  # (seq, before, preempts)
        self._num_preemptions = 0
        self._num_prefill_steps = 0
        self._num_decode_steps = 0
        self._num_mixed_steps = 0
        self._mixed = config.scheduling_policy == "mixed"
        # LoRA: at most max_loras adapters among the running sequences (adapter_limit.py).
        self._lora = config.max_loras > 0
        # Plans issued, and the number of the latest plan recorded (BatchPlan.step_id).
        self._step_id = 0
        self._recorded_step_id = 0
        self._events: list[SchedulerEvent] | None = [] if record_events else None

    @property
    def running(self) -> list[Sequence]:
        """The running sequences in admission order (preemption takes the newest): a copy."""
        return list(self._running)

    @property
    def waiting(self) -> list[Sequence]:
        """The queued sequences in the order they will be admitted: a copy."""
        return list(self._waiting)

    def drain_events(self) -> list[SchedulerEvent]:
        """The events recorded since the last call, oldest first (then forgotten).

        Raises :class:`ConfigurationError` if the scheduler records none.
        """
        events = self._events
        if events is None:
            raise ConfigurationError(
                "this scheduler records no events: create it with "
                "Scheduler(config, record_events=True) to drain them."
            )
        self._events = []
        return events

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence, forks: SequenceABC[Sequence] = ()) -> None:
        """Queue a new request. Raises :class:`InvalidRequestError` if it can never run.

        ``forks`` are the request's other completions (``n > 1``): fresh sequences with the
        same prompt, each with its own id and parameters (its seed), that share ``seq``'s KV
        and draw their first token from ``seq``'s last prompt row.
        """
        limit = self.config.max_model_len
        if seq.num_tokens == 0:
            raise InvalidRequestError("the prompt is empty: a request needs at least one token.")
        if seq.num_tokens + 1 > limit:
            raise InvalidRequestError(
                f"the prompt has {seq.num_tokens} tokens; with the first generated token that "
                f"exceeds max_model_len={limit}. Shorten the prompt to at most {limit - 1} "
                "tokens or raise max_model_len."
            )
        if seq.seq_id in self._seqs:
            raise InvalidRequestError(f"request id {seq.seq_id} is already queued or running.")
        if seq.lora is not None and not self._lora:
            raise InvalidRequestError(
                f"the request asks for LoRA adapter {seq.lora.lora_name!r}, but this scheduler "
                "serves no adapters (max_loras=0): enable LoRA (enable_lora=True, max_loras)."
            )
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.slot >= 0:
            raise InvalidRequestError(f"{seq!r} is not a fresh request.")
        if forks:
            check_new_forks(seq, forks, self._seqs, self.config)
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)
        if forks:
            self._forks.add(seq, list(forks))
            for child in forks:
                self._seqs[child.seq_id] = child

    def get(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence ``seq_id`` (waiting, running, or a completion that has not
        started yet), or ``None``: unknown, or finished. The scheduler forgets a sequence when
        it finishes (memory stays bounded by what is unfinished); keep your own reference
        (the object passed to :meth:`add`), or read it from its
        :class:`~pagedinfer.domain.events.SequenceFinished` event."""
        return self._seqs.get(seq_id)

    def unstarted_forks(self, seq_id: int | None = None) -> list[Sequence]:
        """Completions (``n > 1``) that do not run on their own yet: of request ``seq_id``,
        or of every request. Those of the plan in flight hold blocks and slots already."""
        return self._forks.unstarted(seq_id)

    @property
    def pending_block_copies(self) -> list[tuple[int, int]]:
        """``(source, destination)`` block copies not yet known to have run; each pins its
        source block with one reference until then."""
        forks = self._forks
        return [
            copy
            for table in (forks.copies_after_fork, forks.block_copies)
            for copies in table.values()
            for copy in copies
        ]

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> BatchPlan | None:
        """The next step's plan, or ``None`` when nothing can run.

        With the pool owned by this scheduler, ``None`` means no request is unfinished. A
        pool shared with something else that holds blocks can leave requests unable to
        grow: they are preempted (never an exception) and ``None`` is returned until blocks
        come back.
        """
        self._forget_unrecorded_plans()
        return self._plan_next()

    def _forget_unrecorded_plans(self) -> None:
        """A plan still in flight at :meth:`schedule` was never recorded (its step failed,
        or is run again): the state goes back to before it, and what it planned is planned
        again."""
        if self._ahead is not None:
            self._roll_back()  # neither plan in flight was recorded: as if none had run
        if self._forks.forking:
            self._undo_forks()  # the step that forked them never ran (or was not recorded)
        if self._tier is not None:
            self._tier.forget()  # its copies out are lost, its copies in go again
        self._in_flight = None

    def _roll_back(self) -> None:
        """Neither the plan moved on by :meth:`_move_on` nor the one planned after it was
        recorded (a step failed): back to the state before the advance, as if it never ran.
        Sequences finished or preempted since keep what that did."""
        plan = self._ahead
        assert plan is not None
        self._ahead = None
        restore_chunks(self._advanced_chunks, self._seqs, self._allocator)
        self._advanced_chunks = []
        self._awaiting = set()
        self._rows.roll_back(plan, self._seqs, self._running)
        self._prefilling = [seq for seq in self._running if not seq.decoding]

    def _undo_forks(self) -> None:
        """The plan that forked was never recorded: back to pending, planned again later."""
        for child in self._forks.undo():
            self._release_blocks(child)
            self._slots.release(child)
            child.num_computed_tokens = 0
            child.num_cached_tokens = 0
            child.status = SequenceStatus.WAITING

    def schedule_ahead(self) -> BatchPlan | None:
        """The next step's plan while the latest plan still runs (async scheduling), or
        ``None`` when nothing else can run before that plan is recorded.

        The state moves on as if every sequence in the plan in flight continues: each of its
        decode rows gets :data:`~pagedinfer.domain.plan.PENDING_TOKEN` as its next token
        (in ``token_ids``, until :meth:`postprocess` records the real one), and a decode row
        of the new plan whose input is that token lists it in ``carried_rows`` /
        ``carried_samples``: the executor takes it from the previous step's samples. Partial
        prefill chunks count as computed; a chunk that samples (a prompt's last token) waits
        for the record, and its sequence runs again in the plan after. Then call
        :meth:`postprocess` on the plan in flight (before the new one): a sequence that
        finished there has its row of the new plan discarded when that is postprocessed.
        If the plan in flight fails, the plan made ahead of its tokens fails with it: end
        (:meth:`abort`) the sequences with a row in either, then call :meth:`schedule`,
        which rolls both plans back and plans the rest again (the engine does this).
        Rolling back sequences that go on is not supported.

        Raises ``ValueError`` unless exactly one plan is in flight: the latest plan from
        :meth:`schedule` or :meth:`schedule_ahead` whose predecessor was postprocessed.
        """
        self._policy.check_plan_ahead()
        plan = self._in_flight
        if plan is None or self._ahead is not None:
            raise ValueError(
                "schedule_ahead() plans one step ahead of the plan in flight: call it after "
                "schedule() (or after the previous plan in flight was postprocessed), once."
            )
        self._move_on(plan, None)
        self._in_flight = None
        return self._plan_next()

    def _plan_next(self) -> BatchPlan | None:
        # Each pass either returns a plan or preempts one running sequence, so this ends.
        for _ in range(len(self._running) + 2):
            plan = self._plan_mixed() if self._mixed else self._plan_prefill_first()
            if plan is not None:
                self._rows.planned()
                return self._issue(plan)
            blocked = self._blocked()
            if any(seq.seq_id not in blocked for seq in self._running):
                # Only stuck partial prefills are left: free the newest so the others move.
                self._preempt(self._running[-1])
            elif not self._waiting or self._ahead is not None:
                break  # (planning ahead: what waits may wait for the record)
        tier = self._tier  # nothing computes, but blocks may move between the KV tiers
        plan = tier.copy_plan(self._step_id, self._recorded_step_id, self._ahead) if tier else None
        return self._issue(plan) if plan is not None else None

    def _issue(self, plan: BatchPlan) -> BatchPlan:
        plan = self._tier.attach(plan) if self._tier is not None else plan  # and tier copies
        self._step_id = plan.step_id
        self._in_flight = plan
        return plan

    def _blocked(self) -> set[int]:
        """Running sequences whose chunk in the plan in flight samples, or that load blocks."""
        loading = self._tier.loading_ids if self._tier is not None else None
        return self._awaiting | loading if loading else self._awaiting

    def _plan_prefill_first(self) -> BatchPlan | None:
        """Prefill chunks if any can run, else one token for every decoding sequence."""
        chunks = self._schedule_prefill(self.config.max_num_batched_tokens)
        if chunks:
            self._num_prefill_steps += 1
            return self._prefill_plan(chunks)
        if self._schedule_decode():
            self._num_decode_steps += 1
            return self._decode_plan()
        return None

    def _plan_mixed(self) -> BatchPlan | None:
        """One token for every decoding sequence, then prefill chunks in what is left."""
        preemptions = self._num_preemptions
        has_rows = self._schedule_decode()
        budget = self.config.max_num_batched_tokens - len(self._rows.seqs)
        # As in vLLM: a step that had to preempt admits nothing (or it would thrash).
        chunks = self._schedule_prefill(budget, admit=self._num_preemptions == preemptions)
        if not chunks:
            if not has_rows:
                return None
            self._num_decode_steps += 1
            return self._decode_plan()
        if not has_rows:
            self._num_prefill_steps += 1
            return self._prefill_plan(chunks)
        self._num_mixed_steps += 1
        return mixed_batch_plan(
            self._rows.batch.plan(released_slots=(), new_requests=()),
            build_batch_plan(
                chunks, is_prefill=True, block_size=self.block_size, num_groups=self._num_groups
            ),
            **self._header(has_rows=True),
        )

    def _header(self, *, has_rows: bool) -> _Header:
        """The next plan's number and deltas: the sampling deltas and block copies not
        confirmed yet; planning ahead, not those the plan in flight carries (it runs first:
        a copy repeated after its destination was written, or a release and install
        repeated after the request sampled, would undo work that stays), and the decode
        rows (``has_rows``) whose input is the plan in flight's sample."""
        ahead = self._ahead
        released, new_requests = self._slots.unconfirmed(ahead)
        copies = self._forks.copies_to_send(ahead)
        carried = samples = array("q")
        if ahead is not None and has_rows:
            carried, samples = self._rows.carried(ahead)
        return {
            "released_slots": released,
            "new_requests": new_requests,
            "block_copies": copies,
            "step_id": self._step_id + 1,
            "recorded_step_id": self._recorded_step_id,
            "made_ahead": ahead is not None,
            "carried_rows": carried,
            "carried_samples": samples,
        }

    def _prefill_plan(self, chunks: list[ScheduledChunk]) -> BatchPlan:
        return build_batch_plan(
            chunks,
            is_prefill=True,
            block_size=self.block_size,
            num_groups=self._num_groups,  # KV groups: every group's tables
            **self._header(has_rows=False),
        )

    def _decode_plan(self) -> BatchPlan:
        return self._rows.batch.plan(**self._header(has_rows=True))

    def _schedule_prefill(self, budget: int, *, admit: bool = True) -> list[ScheduledChunk]:
        """Chunks for partly prefilled sequences, then (``admit``) new ones, in ``budget``;
        the new ones move from the waiting queue to the running sequences."""
        decision = self._prefill.plan(
            budget,
            self._prefilling,
            self._waiting,
            admit=admit,
            num_running=len(self._running),
            known=self._seqs,
            awaiting=self._blocked(),
            ahead=self._ahead is not None,
            adapters=running_adapters(self._running) if self._lora else None,
        )
        for seq in decision.admitted:
            self._waiting.popleft()
            self._running.append(seq)
            self._prefilling.append(seq)
            num_cached = seq.num_computed_tokens
            if num_cached and self._events is not None:
                readmitted = seq.num_preemptions > 0
                self._events.append(PrefixCacheHit(seq.seq_id, num_cached, readmitted=readmitted))
        return decision.chunks

    def _schedule_decode(self) -> bool:
        """One token for every decoding sequence: give new blocks where needed (preempting
        if none are free) and bring the rows up to date. False when there are no rows."""
        opens_block = self._allocator.opens_block
        for seq in self._rows.blocks_needed(self._running):
            if seq.decoding and opens_block(seq):  # (not preempted earlier in this loop)
                self._give_block(seq)
        return self._rows.update(self._running)

    def _give_block(self, seq: Sequence) -> None:
        """A block for ``seq``'s next token, preempting newer sequences if none is free."""
        while self._allocator.append_block(seq) is None:
            victim = self._decode_victim(seq)
            self._preempt(victim if victim is not None else seq)
            if victim is None:
                return
        self._rows.grew(seq)

    def _decode_victim(self, seq: Sequence) -> Sequence | None:
        """The newest running sequence a pass over the rows in running order has not served
        yet when it reaches ``seq``: anything after ``seq``, else the newest prefill."""
        newest = self._running[-1]
        if newest is not seq:
            return newest
        return self._prefilling[-1] if self._prefilling else None

    # ------------------------------------------------------------ postprocess
    def postprocess(self, plan: BatchPlan, sampled_token_ids: Iterable[int]) -> list[Sequence]:
        """Record a finished step: advance, cache full blocks, append samples, finish.

        ``plan`` is the plan the latest :meth:`schedule` returned; ``sampled_token_ids``
        holds one token per sampled row. Returns the sequences that received a token,
        finished ones included (``status`` says which), in row order. Sequences aborted
        since the plan was made are skipped (finishes without a token, aborts and cancelled
        completions, are reported only as events). Raises ``ValueError``, recording nothing,
        for another plan than the latest or a wrong number of tokens; once it returns, the
        plan is recorded (the next plan's ``recorded_step_id`` is its ``step_id``).
        """
        ahead = self._ahead
        if plan is not (ahead if ahead is not None else self._in_flight):
            raise ValueError(
                "postprocess() takes the plan returned by the latest schedule(), once (with "
                "schedule_ahead(): the older plan in flight first)."
            )
        tokens = (
            sampled_token_ids if isinstance(sampled_token_ids, list) else list(sampled_token_ids)
        )
        if len(tokens) != plan.num_samples:
            raise ValueError(
                f"{len(tokens)} sampled token ids for a plan that samples {plan.num_samples} "
                "rows: pass exactly one token id per sampled row."
            )
        if ahead is None:  # not moved on by schedule_ahead(): now, with the tokens known
            self._in_flight = None
            self._move_on(plan, tokens)
        return self._record(plan, tokens, filled=ahead is None)

    def _move_on(self, plan: BatchPlan, tokens: list[int] | None) -> None:
        """Move the state on as if ``plan``'s step ran and every sequence in it continues:
        its decode rows get their ``tokens`` (``None``, planning ahead: each gets
        :data:`~pagedinfer.domain.plan.PENDING_TOKEN`), its chunks that do not sample count
        as computed. :meth:`_record` does the rest (tokens of sampled chunks, the prefix
        cache, finishes); :meth:`_roll_back` undoes it, should the plan never be recorded."""
        self._ahead = plan
        self._rows.move_on(plan, tokens, self._seqs)
        num_rows = plan.num_decode_rows
        if num_rows == plan.num_seqs:
            return
        sampled = set(plan.sampled_seq_ids[num_rows:])
        rows = zip(plan.seq_ids[num_rows:], plan.query_lens[num_rows:], strict=True)
        for seq_id, num_tokens in rows:
            chunk_seq = self._seqs.get(seq_id)
            if (
                chunk_seq is None
                or chunk_seq.status is not SequenceStatus.RUNNING
                or chunk_seq.decoding
            ):
                continue
            seq = chunk_seq
            if seq_id in sampled:
                self._awaiting.add(seq_id)  # its next step needs this one's token
                continue
            before = seq.num_computed_tokens
            self._advanced_chunks.append((seq, before, seq.num_preemptions))
            seq.num_computed_tokens = before + num_tokens
            self._maybe_start_decoding(seq)

    def _maybe_start_decoding(self, seq: Sequence) -> None:
        """Prompt done (or one prompt token left over): one token per step from now on."""
        # A request's last prompt token forks in a prefill step, never in a decode.
        if self._policy.ready_to_decode(seq) and seq.seq_id not in self._forks.pending:
            self._prefilling.remove(seq)
            self._rows.join(seq)

    def _record(self, plan: BatchPlan, tokens: list[int], *, filled: bool) -> list[Sequence]:
        """The record of a plan :meth:`_move_on` moved on (``filled``: with its decode rows'
        tokens; else they are pending): write the tokens in, then the prefix cache, the
        sampled chunks, the finishes."""
        self._ahead = None
        self._recorded_step_id = plan.step_id
        self._confirm_deltas(plan)
        awaiting, self._awaiting = self._awaiting, set()
        self._advanced_chunks = []
        num_rows = plan.num_decode_rows
        updated: list[Sequence] = []
        if num_rows:
            decode_tokens = tokens if len(tokens) == num_rows else tokens[:num_rows]
            updated, finishing = self._rows.record(plan, decode_tokens, self._seqs, filled=filled)
            for seq in sorted(finishing, key=updated.index):  # in row order
                self._finish(seq, finishing[seq])
        if num_rows < plan.num_seqs:
            updated += self._record_chunks(plan, tokens, num_rows, awaiting, filled=filled)
        if self._tier is not None:  # blocks copied in from the host tier are computed now
            for seq in self._tier.land(plan.step_id, self._allocator, self._events):
                self._maybe_start_decoding(seq)
        return updated

    def _record_chunks(
        self,
        plan: BatchPlan,
        tokens: list[int],
        first_row: int,
        awaiting: set[int],
        *,
        filled: bool,
    ) -> list[Sequence]:
        """The chunks of ``plan`` (its rows from ``first_row``; ``tokens`` are all of its
        samples). :meth:`_move_on` counted those that do not sample; ``awaiting`` are the
        others. Planned ahead (not ``filled``), a sequence preempted since the plan was
        made still gets its token (its step ran)."""
        sampled = dict(zip(plan.sampled_seq_ids[first_row:], tokens[first_row:], strict=True))
        verified = verified_rows(plan, tokens) if plan.verify_rows else None
        updated: list[Sequence] = []
        rows = zip(plan.seq_ids[first_row:], plan.query_lens[first_row:], strict=True)
        for seq_id, num_tokens in rows:
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue
            running = seq.status is SequenceStatus.RUNNING
            if seq_id not in awaiting:
                if running:
                    self._register_full_blocks(seq)  # counted when moved on
                continue
            if not running and filled:
                continue
            if verified is not None and seq_id in verified:
                if self._record_verified(seq, num_tokens, *verified[seq_id]):
                    updated.append(seq)
                continue
            if running and not seq.decoding:
                seq.num_computed_tokens += num_tokens
            token = sampled[seq_id]
            seq.token_ids.append(token)
            if seq.spec_token_ids:
                seq.spec_token_ids = []  # guesses after the previous last token
            if running:
                self._register_full_blocks(seq)
            updated.append(seq)
            for child in self._forks.forking.pop(seq_id, ()):  # completions sampled here too
                self._start_fork(child, sampled[child.seq_id], updated)
            reason = self._stops.finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
            elif running and not seq.decoding:
                self._maybe_start_decoding(seq)
        return updated

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Offer ``seq``'s full blocks to the prefix cache; a sliding window may free its
        first blocks in place, so a decode row planned ahead for it is refreshed."""
        self._allocator.register_full_blocks(seq)
        if self._allocator.frees_in_place:
            self._rows.refresh(seq)

    def _start_fork(self, child: Sequence, token: int, updated: list[Sequence]) -> None:
        """The forking step ran: ``child`` has its first token and runs on its own."""
        self._forks.started(child)
        child.token_ids.append(token)
        self._running.append(child)
        if self._policy.ready_to_decode(child):  # its prompt is computed
            self._rows.join(child)
        else:  # speculating: a chunk of its last token and drafts per step
            self._prefilling.append(child)
        self._register_full_blocks(child)
        updated.append(child)
        reason = self._stops.finish_reason(child, token)
        if reason is not None:
            self._finish(child, reason)

    def _confirm_deltas(self, plan: BatchPlan) -> None:
        """The plan ran: the executor has applied its sampling deltas and block copies."""
        self._forks.confirm(plan)
        self._slots.confirm(plan)

    # --------------------------------------------------- speculative decoding
    @property
    def num_accepted_tokens(self) -> int:
        """Drafts accepted since the start (speculative decoding)."""
        return self._verify.num_accepted_tokens

    def set_drafts(self, seq_id: int, draft_token_ids: SequenceABC[int]) -> int:
        """Drafts (speculative decoding) for the tokens after running sequence ``seq_id``'s
        last one, replacing any it had; the next step that computes its last token verifies
        them. Kept: at most ``num_speculative_tokens``, and none past the sequence's length
        limit (``max_tokens``, ``max_model_len``). Returns how many were kept (0 for an
        unknown, waiting or finished sequence, or with speculation off)."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.status is not SequenceStatus.RUNNING:
            return 0
        room = self._stops.length_limit(seq) - seq.num_tokens - 1  # the bonus token on top
        seq.spec_token_ids = self._policy.drafts(draft_token_ids, room)
        return len(seq.spec_token_ids)

    def _record_verified(
        self, seq: Sequence, num_tokens: int, drafts: list[int], samples: list[int]
    ) -> bool:
        """A verify row ran: keep the drafts its samples accept, then the next sample (the
        correction or the bonus token); stop at a token that finishes the sequence. False
        when the sequence left the running ones since (its tokens are discarded)."""
        if seq.status is not SequenceStatus.RUNNING:
            return False
        kept = self._verify.accept(drafts, samples)
        # The row computed the tokens up to the last one and the accepted drafts' positions.
        computed = seq.num_computed_tokens + num_tokens - len(drafts) + len(kept) - 1
        seq.spec_token_ids = []
        for token in kept:
            seq.token_ids.append(token)
            reason = self._stops.finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                return True
        seq.num_computed_tokens = computed
        self._register_full_blocks(seq)
        return True

    # -------------------------------------------------------- finish, preempt
    def finish(self, seq_id: int, reason: FinishReason) -> Sequence | None:
        """Finish a request now (stop string matched, caller abort). ``None`` if unknown."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        self._finish(seq, reason)
        return seq

    def abort(self, seq_id: int) -> bool:
        """Free everything request ``seq_id`` holds, in any state. False if it is unknown."""
        return self.finish(seq_id, FinishReason.ABORT) is not None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.token_ids and seq.token_ids[-1] == PENDING_TOKEN:
            seq.token_ids.pop()  # its step is in flight: the token is discarded
        if seq.seq_id in self._forks.parent:  # a completion that has not started yet
            parent_id = self._forks.remove(seq)
            if parent_id is not None:
                self._no_more_forks(parent_id)
        elif seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
            self._stop_running(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
        self._release_blocks(seq)
        self._slots.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        if self._events is not None:
            self._events.append(SequenceFinished(seq, reason))
        # Completions that were to fork from it end with it (it ended before its prompt was
        # computed: an abort).
        for child in self._forks.orphans(seq.seq_id):
            self._finish(child, reason)

    def _no_more_forks(self, parent_id: int) -> None:
        """The last pending fork of ``parent_id`` is gone: a parent that stayed prefilling
        with one prompt token left only to fork decodes it like any other sequence."""
        parent = self._seqs.get(parent_id)
        if (
            parent is not None
            and parent.status is SequenceStatus.RUNNING
            and not parent.decoding
            and self._policy.ready_to_decode(parent)
            and self._in_flight is None  # else recording the plan in flight does this
            and self._ahead is None
        ):
            self._prefilling.remove(parent)
            self._rows.join(parent)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: release the blocks and go back to the front of the queue."""
        self._running.remove(seq)
        self._stop_running(seq)
        self._release_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._waiting.appendleft(seq)
        self._num_preemptions += 1
        if self._events is not None:
            self._events.append(SequencePreempted(seq.seq_id, seq.num_tokens))

    def _stop_running(self, seq: Sequence) -> None:
        """Take a sequence that leaves ``running`` out of its phase's bookkeeping."""
        if seq.decoding:
            self._rows.leave(seq)
        else:
            self._prefilling.remove(seq)

    def _release_blocks(self, seq: Sequence) -> None:
        # A fork's pending copy targets one of these blocks: it must not run once they are
        # free (finished, preempted or undone; a preempted fork recomputes instead).
        self._forks.drop_copy(seq.seq_id)
        self._allocator.free(seq)  # (a load from the host tier not landed is cancelled)

    # ------------------------------------------------------------------ stats
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_preemptions=self._num_preemptions,
            num_prefill_steps=self._num_prefill_steps,
            num_decode_steps=self._num_decode_steps,
            num_mixed_steps=self._num_mixed_steps,
            num_spec_verify_rows=self._verify.num_rows,
            num_draft_tokens=self._verify.num_draft_tokens,
            num_accepted_tokens=self._verify.num_accepted_tokens,
            accepted_per_position=tuple(self._verify.accepted_per_position),
        )

    def kv_group_usage(self) -> tuple[KVGroupUsage, ...]:
        """Each KV group's blocks held by the running sequences and the forks in flight
        (hybrid attention); ``()`` with one full-attention group (see :meth:`stats` and
        the pool's statistics for the whole pool)."""
        allocator = self._allocator
        if not isinstance(allocator, GroupedBlockAllocator):
            return ()
        return allocator.usage([*self._running, *self._forks.unstarted()])

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the incremental bookkeeping disagrees with a
        recomputation from the sequences: phases, decode rows, calendar, slots. O(state);
        for tests, between steps."""
        running, caching = self._running, self.pool.enable_prefix_caching
        if self._prefilling != [seq for seq in running if not seq.decoding]:
            raise AssertionError("the prefilling list is not the running non-decoders")
        for seq in running:
            # Once a step is recorded, a sequence with one token left decodes (a plan never
            # postprocessed may have admitted it with a one-token chunk: then it computed
            # nothing but its cached prefix, and that chunk is planned again).
            if (
                not seq.decoding
                and not computed_only_at_admission(seq, self.block_size, caching=caching)
                and (seq.num_uncomputed_tokens == 0 or self._policy.ready_to_decode(seq))
                and self._in_flight is None
                and self._ahead is None
                and seq.seq_id not in self._forks.pending  # its last prompt token forks
            ):
                raise AssertionError(f"{seq!r} should be decoding")
        for seq in self._waiting:
            if seq.decoding:
                raise AssertionError(f"waiting {seq!r} is marked decoding")
        forking = [child for children in self._forks.forking.values() for child in children]
        self._slots.check(running, list(self._waiting), forking, self.config.max_running)
        in_flight = self._in_flight is not None or self._ahead is not None
        self._forks.check(self._seqs, plan_in_flight=in_flight)
        self._rows.check(running)
        if self._lora:
            AdapterLimit(self.config.max_loras).check(running)
        if self._tier is not None:
            self._tier.check()
