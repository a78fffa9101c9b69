"""The scheduler's side of the host KV tier (:mod:`pagedinfer.domain.host_tier`).

Two kinds of copy travel in plans (``BatchPlan.kv_copies_out`` / ``kv_copies_in``), executed
before the step's forward, copies out first:

* *out*: a block the device pool evicted from its prefix cache while this plan was made (its
  physical block now belongs to something this step may write) goes to a host slot;
* *in*: a request admitted with blocks found in the tier (after the device's own prefix hits)
  holds fresh device blocks for them; the plan after its admission copies them in.

A copy counts as landed once the plan that carried it is recorded (``postprocess``): only then
is a copied-in block computed for its request (which waits, admitted and holding its blocks,
while other requests run) and a copied-out block findable in the tier. A plan that is never
recorded (a failed step) abandons its copies out (the device block may have been overwritten)
and sends its copies in again with the next plan. :class:`TierLink` returns decisions and
never calls back into the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pagedinfer.domain.block_pool import BlockPool
from pagedinfer.domain.events import PrefixCacheHit, SchedulerEvent
from pagedinfer.domain.host_tier import HostTier, TierEntry
from pagedinfer.domain.plan import BatchPlan, build_batch_plan
from pagedinfer.domain.scheduler.config import SchedulerConfig
from pagedinfer.domain.sequence import Sequence
from pagedinfer.errors import ConfigurationError

if TYPE_CHECKING:
    from pagedinfer.domain.scheduler.allocator import BlockAllocator

__all__ = ["HostTierViews", "Load", "TierLink", "host_tier_link"]


def host_tier_link(config: SchedulerConfig, pool: BlockPool) -> TierLink | None:
    """The tier of ``config.num_host_blocks`` slots behind ``pool``, or ``None`` (none asked,
    no prefix cache). Raises for hybrid attention (KV groups: not implemented)."""
    if not config.num_host_blocks or not pool.enable_prefix_caching:
        return None
    if not config.is_plain:
        raise ConfigurationError(
            "kv_offloading_size (a host KV tier) is not implemented for models with several "
            "KV groups (sliding-window or hybrid attention): leave it unset for this model."
        )
    return TierLink(HostTier(config.num_host_blocks, config.block_size), pool)


@dataclass(slots=True)
class Load:
    """A request's blocks on their way in: ``entries[i]`` is copied to device ``blocks[i]``,
    by the plan ``step_id`` (0: not sent yet)."""

    seq: Sequence
    entries: list[TierEntry]
    blocks: list[int]
    step_id: int = 0
    waited_steps: int = field(default=0)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class TierLink:
    """The copies between ``pool`` (the device) and ``tier`` (the host) of one scheduler."""

    __slots__ = ("_loads", "_outs", "_pool", "tier")

    def __init__(self, tier: HostTier, pool: BlockPool) -> None:
        if tier.block_size != pool.block_size:
            raise ValueError("the host tier and the block pool must share a block size")
        self.tier = tier
        self._pool = pool
        pool.record_evictions()
        self._outs: list[list[int]] = []  # [device block, host slot, step id (0: unsent)]
        self._loads: dict[int, Load] = {}  # by sequence id

    # ----------------------------------------------------------------- queries
    def is_loading(self, seq_id: int) -> bool:
        return seq_id in self._loads

    @property
    def loading_ids(self) -> set[int]:
        return set(self._loads)

    def has_unsent(self) -> bool:
        """Whether some copy waits for a plan to carry it."""
        self._collect_evictions()
        return any(out[2] == 0 for out in self._outs) or any(
            load.step_id == 0 for load in self._loads.values()
        )

    def find(self, seq: Sequence, device_hits: int, max_blocks: int) -> list[TierEntry]:
        """``seq``'s blocks ``device_hits .. max_blocks - 1`` found in the tier, from the first."""
        if device_hits >= max_blocks:
            return []
        parent = seq.block_hashes[device_hits - 1] if device_hits else None
        return self.tier.find(seq.block_hashes[:max_blocks], seq.token_ids, device_hits, parent)

    # --------------------------------------------------------------- mutations
    def pin(self, entries: list[TierEntry]) -> None:
        """Pin ``entries`` before device blocks are allocated for them (an allocation may
        evict device blocks into the tier, which must not evict these)."""
        self.tier.take(entries)

    def start_load(self, seq: Sequence, entries: list[TierEntry], blocks: list[int]) -> None:
        """``seq`` waits for pinned ``entries`` to be copied into its device ``blocks``."""
        self._loads[seq.seq_id] = Load(seq, entries, blocks)

    def attach(self, plan: BatchPlan) -> BatchPlan:
        """``plan`` with the copies no plan carries yet (those made while it was planned
        included): they are now sent with it."""
        self._collect_evictions()
        step_id = plan.step_id
        outs: list[tuple[int, int]] = []
        for out in self._outs:
            if out[2] == 0:
                out[2] = step_id
                outs.append((out[0], out[1]))
        ins: list[tuple[int, int]] = []
        for load in self._loads.values():
            load.waited_steps += 1
            if load.step_id == 0:
                load.step_id = step_id
                ins.extend(
                    (entry.slot, block)
                    for entry, block in zip(load.entries, load.blocks, strict=True)
                )
        self.tier.record_load_wait(len(self._loads))
        if not outs and not ins:
            return plan
        return replace(plan, kv_copies_out=tuple(outs), kv_copies_in=tuple(ins))

    def recorded(self, step_id: int) -> list[Load]:
        """Plans up to ``step_id`` ran: their copies landed. Returns the loads now complete
        (their requests go on)."""
        if self._outs:
            kept: list[list[int]] = []
            for out in self._outs:
                if 0 < out[2] <= step_id:
                    self.tier.copied_out(out[1])
                else:
                    kept.append(out)
            self._outs = kept
        landed = [load for load in self._loads.values() if 0 < load.step_id <= step_id]
        for load in landed:
            del self._loads[load.seq.seq_id]
            for entry in load.entries:
                self.tier.copied_in(entry.slot)
        return landed

    def land(
        self, step_id: int, allocator: BlockAllocator, events: list[SchedulerEvent] | None
    ) -> list[Sequence]:
        """Plans up to ``step_id`` ran: the blocks copied in count as computed (and cached,
        at a request's first admission) and go into the device's prefix cache, a
        :class:`PrefixCacheHit` each in ``events``. Returns the sequences whose load landed."""
        size = self._pool.block_size
        landed: list[Sequence] = []
        for load in self.recorded(step_id):
            seq = load.seq
            loaded = load.num_blocks * size
            seq.num_computed_tokens += loaded
            readmitted = seq.num_preemptions > 0
            if not readmitted:
                seq.num_cached_tokens += loaded
            allocator.register_full_blocks(seq)
            if events is not None:
                events.append(PrefixCacheHit(seq.seq_id, loaded, readmitted=readmitted))
            landed.append(seq)
        return landed

    def copy_plan(
        self, last_step_id: int, recorded_step_id: int, ahead: BatchPlan | None
    ) -> BatchPlan | None:
        """The next plan (after ``last_step_id``; ``ahead``: the plan in flight, planning
        ahead) with no rows for copies waiting to be sent when nothing else runs, or ``None``.
        It carries no sampling deltas or fork copies: those wait for a plan with rows (they
        are confirmed only by a plan that carried them)."""
        if not self.has_unsent():
            return None
        return build_batch_plan(
            [],
            is_prefill=True,
            block_size=self._pool.block_size,
            step_id=last_step_id + 1,
            recorded_step_id=recorded_step_id,
            made_ahead=ahead is not None,
        )

    def forget(self) -> None:
        """Every plan sent and not recorded is dropped (a failed step): copies out are
        abandoned, copies in go with the next plan."""
        if self._outs:
            kept: list[list[int]] = []
            for out in self._outs:
                if out[2]:
                    self.tier.abandon(out[1])
                else:
                    kept.append(out)
            self._outs = kept
        for load in self._loads.values():
            load.step_id = 0

    def release(self, seq: Sequence) -> None:
        """``seq`` gives its blocks back (finished, aborted, preempted): a load not landed
        is cancelled and its blocks stay in the tier."""
        load = self._loads.pop(seq.seq_id, None)
        if load is not None:
            for entry in load.entries:
                self.tier.give_back(entry.slot)

    def reset(self) -> None:
        """Forget the tier's resident blocks (``reset_prefix_cache``)."""
        self.tier.reset()

    def check(self) -> None:
        """Raise ``AssertionError`` unless every load's request runs, holds its blocks and
        has not counted them as computed; and the tier's own invariants hold."""
        self.tier.check_integrity()
        size = self._pool.block_size
        for seq_id, load in self._loads.items():
            seq = load.seq
            if seq.seq_id != seq_id or not set(load.blocks) <= set(seq.block_table):
                raise AssertionError(f"load of {seq!r} targets blocks it does not hold")
            first = seq.block_table.index(load.blocks[0])
            if seq.num_computed_tokens > first * size:
                raise AssertionError(f"{seq!r} counts blocks still being copied in as computed")

    # ---------------------------------------------------------------- private
    def _collect_evictions(self) -> None:
        tier = self.tier
        for block_id, digest, parent, token_ids in self._pool.drain_evictions():
            slot = tier.offer(digest, parent, token_ids)
            if slot is not None:
                self._outs.append([block_id, slot, 0])


class HostTierViews:
    """The :class:`~pagedinfer.domain.scheduler.Scheduler`'s public side of its host KV tier
    (a base class: the tier's queries beside the loop, not in it)."""

    pool: BlockPool
    _tier: TierLink | None

    @property
    def host_tier(self) -> HostTier | None:
        """The host KV tier behind the pool (``num_host_blocks``), for its statistics."""
        return self._tier.tier if self._tier is not None else None

    @property
    def loading_seq_ids(self) -> set[int]:
        """Running sequences waiting for their blocks from the host tier: they hold them and
        compute nothing until a recorded plan carried their copies."""
        return self._tier.loading_ids if self._tier is not None else set()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, on the device and in the host tier."""
        self.pool.reset_prefix_cache()
        if self._tier is not None:
            self._tier.reset()
