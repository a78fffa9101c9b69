"""Who runs this step: prefill-first FCFS scheduling with chunked prefill and preemption.

One step is either a *prefill* step (new or partially prefilled sequences, any number of
tokens each) or a *decode* step (one token for every running sequence whose prompt is
done). The scheduler owns the block pool: it allocates the blocks a step writes before the
step runs and registers full blocks in the prefix cache after it ran (``postprocess``), so a
block is only ever shared once its K/V exist.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedinfer.domain.block_pool import BlockPool, cdiv
from pagedinfer.domain.hashing import extend_chain
from pagedinfer.domain.plan import BatchPlan, ScheduledChunk, build_batch_plan
from pagedinfer.domain.sequence import FinishReason, Sequence, SequenceStatus
from pagedinfer.errors import ConfigurationError, InvalidRequestError

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 256
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"{name}={value!r} is invalid: expected an integer >= 1.")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ConfigurationError(
                f"max_model_len={self.max_model_len!r} is invalid: expected an integer >= 2 "
                "(one prompt token plus one generated token)."
            )
        capacity = self.num_blocks * self.block_size
        if capacity < self.max_model_len:
            raise ConfigurationError(
                f"the KV pool holds {capacity} tokens ({self.num_blocks} blocks x "
                f"{self.block_size}) but max_model_len is {self.max_model_len}: the pool must "
                "hold at least one max_model_len sequence. Give it more blocks (more memory, "
                "num_kv_blocks) or lower max_model_len."
            )

    @property
    def max_running(self) -> int:
        # Every running sequence must fit in one decode step, or some would starve.
        return min(self.max_num_seqs, self.max_num_batched_tokens)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_preemptions: int
    num_prefill_steps: int
    num_decode_steps: int


class Scheduler:
    """Turns queued sequences into :class:`BatchPlan` s and sampled tokens into progress.

    Call :meth:`schedule` for a plan, run it, then hand the sampled token ids (one per
    ``plan.sampled_seq_ids``) to :meth:`postprocess`.
    """

    def __init__(self, config: SchedulerConfig, pool: BlockPool | None = None) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = pool or BlockPool(
            config.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        if self.pool.block_size != config.block_size or self.pool.num_blocks != config.num_blocks:
            raise ConfigurationError("the block pool does not match the scheduler config")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preemption takes the newest
        self._seqs: dict[int, Sequence] = {}
        self._num_preemptions = 0
        self._num_prefill_steps = 0
        self._num_decode_steps = 0

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        """Queue a new request. Raises :class:`InvalidRequestError` if it can never run."""
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
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise InvalidRequestError(f"{seq!r} is not a fresh request.")
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def get(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

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
        # Each pass either returns a plan or preempts one running sequence, so this ends.
        for _ in range(len(self.running) + 2):
            chunks = self._schedule_prefill()
            if chunks:
                self._num_prefill_steps += 1
                return build_batch_plan(chunks, is_prefill=True, block_size=self.block_size)
            chunks = self._schedule_decode()
            if chunks:
                self._num_decode_steps += 1
                return build_batch_plan(chunks, is_prefill=False, block_size=self.block_size)
            if self.running:
                # Only stuck partial prefills are left: free the newest so the others move.
                self._preempt(self.running[-1])
            elif not self.waiting:
                break
        return None

    def _schedule_prefill(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        # Partially prefilled sequences first: they already hold blocks.
        for seq in self.running:
            if budget == 0:
                return chunks
            if seq.num_uncomputed_tokens <= 1:
                continue  # decoding (or a one-token prompt tail, which a decode step serves)
            num_tokens = min(seq.num_uncomputed_tokens, budget, self._growth_capacity(seq))
            if num_tokens > 0:
                self._grow(seq, num_tokens)
                chunks.append(ScheduledChunk(seq, num_tokens))
                budget -= num_tokens
        # Then admit waiting requests in arrival order, stopping at the first that does not fit.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            num_tokens = self._admit(seq, budget)
            if num_tokens == 0:
                break
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
        return chunks

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give ``seq`` its cached prefix and blocks for its first chunk; 0 if they don't fit."""
        pool = self.pool
        size = self.block_size
        hits = []
        if pool.enable_prefix_caching:
            # At least one token must be computed to get logits, so a fully cached prompt
            # still recomputes its last block.
            max_hit_blocks = (seq.num_tokens - 1) // size
            extend_chain(seq.block_hashes, seq.token_ids, size, max_hit_blocks, seq.extra_key)
            hits = pool.find_cached_prefix(seq.block_hashes[:max_hit_blocks], seq.token_ids)
        num_cached = len(hits) * size
        num_tokens = min(seq.num_tokens - num_cached, budget)
        num_new_blocks = cdiv(num_cached + num_tokens, size) - len(hits)
        if num_new_blocks + pool.cost_of_acquiring(hits) > pool.num_free_blocks:
            return 0
        pool.acquire(hits)  # before allocating, so allocation cannot evict a hit
        new_blocks = pool.allocate(num_new_blocks)
        seq.block_table = [block.block_id for block in hits]
        seq.block_table.extend(block.block_id for block in new_blocks)
        if seq.num_preemptions == 0:
            # Re-admitted after preemption, a request finds its own earlier blocks: those hits
            # are not prompt tokens served by the cache, and may even be completion tokens.
            seq.num_cached_tokens = num_cached
        seq.num_computed_tokens = num_cached
        seq.num_registered_blocks = len(hits)
        seq.status = SequenceStatus.RUNNING
        if pool.enable_prefix_caching:
            pool.record_prefix_lookup(seq.num_tokens, num_cached)
        return num_tokens

    def _schedule_decode(self) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue  # preempted earlier in this loop, or still prefilling
            while self._growth_capacity(seq) < 1:
                victim = self._newest_unscheduled(exclude=seq, scheduled=scheduled)
                self._preempt(victim if victim is not None else seq)
                if victim is None:
                    break
            else:
                self._grow(seq, 1)
                chunks.append(ScheduledChunk(seq, 1))
                scheduled.add(seq.seq_id)
        return chunks

    def _newest_unscheduled(self, *, exclude: Sequence, scheduled: set[int]) -> Sequence | None:
        for seq in reversed(self.running):
            if seq is not exclude and seq.seq_id not in scheduled:
                return seq
        return None

    def _growth_capacity(self, seq: Sequence) -> int:
        """How many more tokens ``seq`` can compute with its blocks plus all free blocks."""
        slots = (len(seq.block_table) + self.pool.num_free_blocks) * self.block_size
        return slots - seq.num_computed_tokens

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        needed = cdiv(seq.num_computed_tokens + num_tokens, self.block_size)
        missing = needed - len(seq.block_table)
        if missing > 0:
            seq.block_table.extend(block.block_id for block in self.pool.allocate(missing))

    # ------------------------------------------------------------ postprocess
    def postprocess(self, plan: BatchPlan, sampled_token_ids: Iterable[int]) -> list[Sequence]:
        """Record a finished step: advance, cache full blocks, append samples, finish.

        ``sampled_token_ids`` holds one token per ``plan.sampled_seq_ids``. Returns the
        sequences that received a token, finished ones included (``status`` says which).
        Sequences aborted since the plan was made are skipped.
        """
        for seq_id, num_tokens in zip(plan.seq_ids, plan.query_lens, strict=True):
            seq = self._seqs.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += num_tokens
            self._register_full_blocks(seq)
        updated: list[Sequence] = []
        for seq_id, token_id in zip(plan.sampled_seq_ids, sampled_token_ids, strict=True):
            seq = self._seqs.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            seq.token_ids.append(token_id)
            updated.append(seq)
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)
        return updated

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.params
        num_completion = seq.num_completion_tokens
        # min_tokens completion tokens come before EOS or a stop token may end the request
        # (the sampler holds them back; a sampler that does not cannot end it early).
        if num_completion > params.min_tokens:
            if not params.ignore_eos and token_id in self.config.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
        if params.max_tokens is not None and num_completion >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _register_full_blocks(self, seq: Sequence) -> None:
        pool = self.pool
        if not pool.enable_prefix_caching:
            return
        size = self.block_size
        num_full = min(seq.num_computed_tokens // size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = extend_chain(seq.block_hashes, seq.token_ids, size, num_full, seq.extra_key)
        for index in range(seq.num_registered_blocks, num_full):
            block_id = seq.block_table[index]
            if pool.block(block_id).hash is None:
                parent = hashes[index - 1] if index else None
                tokens = seq.token_ids[index * size : (index + 1) * size]
                pool.register(block_id, hashes[index], parent, tokens)
        seq.num_registered_blocks = num_full

    # ---------------------------------------------------------- finish / abort
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
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: release the blocks and go back to the front of the queue."""
        self.running.remove(seq)
        self._release_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self._num_preemptions += 1

    def _release_blocks(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table[::-1])
        seq.block_table = []
        seq.num_registered_blocks = 0

    # ------------------------------------------------------------------ stats
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_preemptions=self._num_preemptions,
            num_prefill_steps=self._num_prefill_steps,
            num_decode_steps=self._num_decode_steps,
        )
