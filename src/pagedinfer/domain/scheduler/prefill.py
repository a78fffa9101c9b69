"""Prefill admission: which prompt chunks run in a step's token budget.

Partly prefilled sequences go first (they hold blocks already), then waiting requests in
arrival order, each cut to what the budget and the free blocks allow (chunked prefill), the
first that does not fit ending the admissions. Around the chunking:

* *drafts* (speculative decoding): a chunk that reaches a sequence's last token also
  computes its drafts (a verify row);
* *lookahead*: such a chunk is given blocks for ``num_lookahead_tokens`` positions past
  it, as far as free blocks allow;
* *forks* (``n > 1``): the chunk that computes a request's last prompt token forks its
  pending completions, only when their block copies fit (else it stops one token short);
* *planned ahead*: a chunk of the plan in flight that samples must be recorded before its
  sequence runs again (``awaiting``), and a preempted request whose token is in flight is
  readmitted only after the record.

:class:`PrefillPlanner` returns its decision (:class:`PrefillDecision`: the chunks, the
requests admitted) and leaves the queues to the loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from pagedinfer.domain.plan import PENDING_TOKEN, ScheduledChunk
from pagedinfer.domain.scheduler.adapter_limit import AdapterLimit
from pagedinfer.domain.scheduler.allocator import BlockAllocator
from pagedinfer.domain.scheduler.config import SchedulerConfig
from pagedinfer.domain.scheduler.fork_table import ForkTable
from pagedinfer.domain.scheduler.slots import SlotTable
from pagedinfer.domain.sequence import Sequence, SequenceStatus

__all__ = ["PrefillDecision", "PrefillPlanner", "computed_only_at_admission"]


@dataclass(slots=True)
class PrefillDecision:
    """A step's prefill work: its ``chunks`` (partly prefilled sequences first, then the new
    ones), and the waiting requests ``admitted`` (the head of the queue, in order: now
    running, the loop moves them)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)


class PrefillPlanner:
    """Prefill chunks of one scheduler: blocks from ``allocator``, forks from ``forks``,
    sampling slots for new requests from ``slots``."""

    __slots__ = ("_adapters", "_allocator", "_forks", "_lookahead", "_max_running", "_slots")

    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockAllocator,
        forks: ForkTable,
        slots: SlotTable,
    ) -> None:
        self._allocator = allocator
        self._forks = forks
        self._slots = slots
        self._lookahead = config.num_lookahead_tokens
        self._max_running = config.max_running
        self._adapters = AdapterLimit(config.max_loras)

    def plan(
        self,
        budget: int,
        prefilling: list[Sequence],
        waiting: deque[Sequence],
        *,
        admit: bool,
        num_running: int,
        known: dict[int, Sequence],
        awaiting: Collection[int],
        ahead: bool,
        adapters: set[int] | None = None,
    ) -> PrefillDecision:
        """Chunks for ``prefilling`` (in order), then (``admit``) for the head of
        ``waiting``, in ``budget`` tokens. ``num_running``: the running sequences now;
        ``known``: the unfinished ones by id; ``awaiting`` (planning ``ahead``): the
        sequences whose chunk in the plan in flight samples; ``adapters``: the running
        sequences' LoRA adapters (None: no limit to keep), which admissions extend."""
        decision = PrefillDecision()
        chunks = decision.chunks
        for seq in prefilling:
            if budget == 0:
                return decision
            if awaiting and seq.seq_id in awaiting:
                continue  # its chunk in the plan in flight samples: planned after the record
            chunk = self._next_chunk(seq, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
        if not admit:
            return decision
        admitted = decision.admitted
        for seq in waiting:
            if budget <= 0 or not self._has_room_for(seq, num_running + len(admitted), known):
                break
            if ahead and (seq.seq_id in awaiting or seq.token_ids[-1] == PENDING_TOKEN):
                break  # preempted with its token in flight: readmitted once it is recorded
            if adapters is not None and not self._adapters.admits(seq, adapters):
                break  # every adapter slot is taken (domain/scheduler/adapter_limit.py)
            num_tokens = self._admit(seq, budget)
            if num_tokens is None:
                break
            admitted.append(seq)
            if adapters is not None and seq.lora is not None:
                adapters.add(seq.lora.lora_int_id)
            if num_tokens == 0:
                continue  # blocks from the host tier are copied in first (scheduler/tier.py)
            forking = seq.seq_id in self._forks.pending and seq.num_uncomputed_tokens == num_tokens
            forks = self._forks.fork(seq, self._slots) if forking else ()
            chunks.append(ScheduledChunk(seq, num_tokens, forks))
            budget -= num_tokens
        return decision

    def _next_chunk(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        """The next chunk of a partly prefilled ``seq`` (its drafts on top), its blocks
        given; ``None`` when none fits."""
        allocator = self._allocator
        wanted = seq.num_uncomputed_tokens + len(seq.spec_token_ids)
        num_tokens = min(wanted, budget, allocator.growth_capacity(seq))
        forking = num_tokens == seq.num_uncomputed_tokens and seq.seq_id in self._forks.pending
        if forking and not self._fork_fits(seq, num_tokens):
            num_tokens -= 1  # not this step: the last prompt token must fork
            forking = False
        if num_tokens <= 0:
            return None
        grown = allocator.allocate_slots(seq, num_tokens)
        assert grown is not None  # within its growth capacity
        if num_tokens > seq.num_uncomputed_tokens and self._lookahead:
            allocator.allocate_lookahead(seq, num_tokens, self._lookahead)
        forks = self._forks.fork(seq, self._slots) if forking else ()
        return ScheduledChunk(seq, num_tokens, forks)

    def _fork_fits(self, seq: Sequence, num_tokens: int) -> bool:
        growth = self._allocator.blocks_missing(seq, num_tokens)
        return growth + self._forks.extra_blocks(seq) <= self._allocator.num_free_blocks

    def _has_room_for(self, seq: Sequence, num_running: int, known: dict[int, Sequence]) -> bool:
        """Whether admitting ``seq`` (and its forks) keeps ``max_running`` sequences at most."""
        # Forks of admitted requests will run: they count from admission on.
        return num_running + self._forks.num_committed(known, seq.seq_id) < self._max_running

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Give ``seq`` its cached prefix and blocks for its first chunk, mark it running;
        ``None`` (changing nothing) if they don't fit; 0 when it waits for blocks copied in
        from the host tier (its first chunk comes after they land)."""
        reserve = self._forks.extra_blocks(seq)  # the chunk forks if whole: copies too
        admission = self._allocator.admit(seq, budget, reserve_if_whole=reserve)
        if admission is None:
            return None
        num_cached = admission.num_cached
        if seq.num_preemptions == 0:
            # Re-admitted after preemption, a request finds its own earlier blocks: those hits
            # are not prompt tokens served by the cache, and may even be completion tokens.
            seq.num_cached_tokens = num_cached
        seq.num_computed_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        if seq.slot < 0:  # first admission (a preempted request keeps its slot)
            self._slots.assign(seq)
        return admission.num_tokens


def computed_only_at_admission(seq: Sequence, block_size: int, *, caching: bool) -> bool:
    """Whether running ``seq`` may have computed nothing since its admission but the prefix
    the cache gave it then (``caching``: prefix caching on). A plan that admitted it and
    was never recorded leaves it so, and a shorter plan made again (decode rows that joined
    meanwhile took the budget) may not give it its chunk: then it prefills on, even with
    one token left. A first admission computed exactly its cached tokens; a readmitted
    request (its own blocks found) a whole number of blocks."""
    computed = seq.num_computed_tokens
    if computed == 0:
        return True
    if not caching or computed % block_size:
        return False
    return seq.num_preemptions > 0 or computed == seq.num_cached_tokens
