"""The host KV tier's index: a second, larger pool of blocks behind the device's prefix cache.

A block evicted from the device pool's prefix cache (its physical block handed to other
content) is offered here: if it is new to the tier, a host *slot* is reserved and the block is
queued for a copy *out* (device to host). A prefix lookup that misses on the device continues
the same hash chain here; each hit is copied back *in* to a fresh device block. The tier is
*exclusive*: a block whose copy in has landed leaves the tier (its content lives on the device
again, where the prefix cache finds it; evicted once more, it is copied out again).

Every slot is in exactly one state:

====================  ==========================================================  ==========
state                 meaning                                                     findable
====================  ==========================================================  ==========
free                  holds nothing
copying out           reserved for a block whose copy out has not landed yet      no
resident              holds a block's K/V; in LRU order, evictable                yes
copying in            being copied to a device block; pinned until it lands       no
====================  ==========================================================  ==========

Slots in flight are neither findable nor evictable, so a lookup never returns a block whose
K/V is not in host memory and a copy never reads a slot that was handed to other content. The
tier never holds more than ``num_slots`` blocks: an offer when every slot is taken evicts the
least recently used resident block, or is dropped when every slot is in flight.

Like :class:`~pagedinfer.domain.block_pool.BlockPool`, every operation costs O(1) per block
it touches, a lookup verifies stored token ids and parent hashes (hash-collision guard), and
no call mutates anything before it has checked its arguments.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from pagedinfer.errors import BlockPoolError

__all__ = ["HostTier", "SlotState", "TierEntry", "TierStats"]


class SlotState(Enum):
    COPYING_OUT = "copying_out"
    RESIDENT = "resident"
    COPYING_IN = "copying_in"


class TierEntry:
    """One occupied host slot: the block it holds (or will hold) and where it is."""

    __slots__ = ("digest", "parent_hash", "slot", "state", "token_ids")

    def __init__(
        self, slot: int, digest: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> None:
        self.slot = slot
        self.digest = digest
        self.parent_hash = parent_hash
        self.token_ids = token_ids
        self.state = SlotState.COPYING_OUT

    def __repr__(self) -> str:
        return f"TierEntry(slot={self.slot}, hash={self.digest}, {self.state.value})"


@dataclass(frozen=True, slots=True)
class TierStats:
    """The tier now, and its counters since the start (blocks, not bytes: the engine knows
    the bytes of one block)."""

    num_slots: int
    num_resident: int
    num_copying_out: int
    num_copying_in: int
    lookup_blocks: int  # blocks looked up here after a device miss
    hit_blocks: int  # of those, found here (each copied in)
    blocks_copied_out: int  # copies out that landed
    blocks_copied_in: int  # copies in that landed
    evictions: int  # resident blocks dropped to make room
    dropped_offers: int  # blocks not kept: every slot was in flight
    load_wait_steps: int  # plans made while requests waited for copies in (summed)

    @property
    def num_used_slots(self) -> int:
        return self.num_resident + self.num_copying_out + self.num_copying_in


class HostTier:
    """``num_slots`` host blocks indexed by the chained block hashes of the device pool."""

    def __init__(self, num_slots: int, block_size: int) -> None:
        if num_slots < 1:
            raise BlockPoolError(f"num_slots={num_slots} is invalid: a host tier needs >= 1.")
        if block_size < 1:
            raise BlockPoolError(f"block_size={block_size} is invalid: it must be >= 1.")
        self.num_slots = num_slots
        self.block_size = block_size
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._by_slot: dict[int, TierEntry] = {}
        self._by_digest: dict[int, TierEntry] = {}  # one entry per hash (any state)
        self._lru: OrderedDict[int, TierEntry] = OrderedDict()  # resident, by slot, oldest first
        self._lookup_blocks = 0
        self._hit_blocks = 0
        self._copied_out = 0
        self._copied_in = 0
        self._evictions = 0
        self._dropped = 0
        self._load_wait_steps = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_used_slots(self) -> int:
        return len(self._by_slot)

    def entry(self, slot: int) -> TierEntry:
        entry = self._by_slot.get(slot)
        if entry is None:
            raise BlockPoolError(f"host slot {slot} holds nothing (slots: 0..{self.num_slots - 1})")
        return entry

    def contains(self, digest: int) -> bool:
        """Whether a block with this hash is here or on its way here (any state)."""
        return digest in self._by_digest

    def find(
        self,
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        start: int,
        parent: int | None,
    ) -> list[TierEntry]:
        """The resident blocks continuing a chain whose first ``start`` blocks were found on
        the device (``parent``: the hash of block ``start - 1``, ``None`` when ``start`` is
        0), up to the first miss. Nothing is mutated: :meth:`take` them."""
        size = self.block_size
        found: list[TierEntry] = []
        for index in range(start, len(block_hashes)):
            digest = block_hashes[index]
            entry = self._by_digest.get(digest)
            if entry is None or entry.state is not SlotState.RESIDENT:
                break
            expected = tuple(token_ids[index * size : (index + 1) * size])
            if entry.token_ids != expected or entry.parent_hash != parent:
                break
            found.append(entry)
            parent = digest
        return found

    # --------------------------------------------------------------- mutations
    def offer(self, digest: int, parent_hash: int | None, token_ids: Sequence[int]) -> int | None:
        """A cached block leaves the device: the slot to copy it out to, or ``None`` when it
        is here already (its recency is refreshed) or every slot is in flight (dropped)."""
        if len(token_ids) != self.block_size:
            raise BlockPoolError(
                f"only full blocks go to the host tier: {len(token_ids)} tokens, block_size "
                f"is {self.block_size}."
            )
        known = self._by_digest.get(digest)
        if known is not None:
            if known.state is SlotState.RESIDENT:
                self._lru.move_to_end(known.slot)
            return None
        if not self._free:
            if not self._lru:
                self._dropped += 1
                return None
            _, victim = self._lru.popitem(last=False)
            self._release(victim)
            self._evictions += 1
        slot = self._free.pop()
        entry = TierEntry(slot, digest, parent_hash, tuple(token_ids))
        self._by_slot[slot] = entry
        self._by_digest[digest] = entry
        return slot

    def copied_out(self, slot: int) -> None:
        """The copy out to ``slot`` landed: the block is resident, most recently used."""
        entry = self._expect(slot, SlotState.COPYING_OUT)
        entry.state = SlotState.RESIDENT
        self._lru[slot] = entry
        self._copied_out += 1

    def abandon(self, slot: int) -> None:
        """The copy out to ``slot`` will not land (its step failed): free the slot."""
        self._release(self._expect(slot, SlotState.COPYING_OUT))

    def take(self, entries: Sequence[TierEntry]) -> None:
        """Pin resident ``entries`` (from :meth:`find`) for their copies in."""
        for entry in entries:
            if self._by_slot.get(entry.slot) is not entry or entry.state is not SlotState.RESIDENT:
                raise BlockPoolError(f"{entry!r} is not a resident block of this tier.")
        for entry in entries:
            entry.state = SlotState.COPYING_IN
            del self._lru[entry.slot]

    def copied_in(self, slot: int) -> None:
        """The copy in from ``slot`` landed: the block lives on the device now; the slot is free."""
        self._release(self._expect(slot, SlotState.COPYING_IN))
        self._copied_in += 1

    def give_back(self, slot: int) -> None:
        """The copy in from ``slot`` is no longer wanted (its request was aborted or
        preempted): the block is resident again, most recently used."""
        entry = self._expect(slot, SlotState.COPYING_IN)
        entry.state = SlotState.RESIDENT
        self._lru[slot] = entry

    def record_lookup(self, looked_up: int, hits: int) -> None:
        self._lookup_blocks += looked_up
        self._hit_blocks += hits

    def record_load_wait(self, num_requests: int) -> None:
        """A plan was made while ``num_requests`` requests waited for their copies in."""
        self._load_wait_steps += num_requests

    def reset(self) -> None:
        """Forget every resident block (blocks in flight finish their copies first)."""
        for entry in list(self._lru.values()):
            self._release(entry)
        self._lru.clear()

    def stats(self) -> TierStats:
        states = [entry.state for entry in self._by_slot.values()]
        return TierStats(
            num_slots=self.num_slots,
            num_resident=len(self._lru),
            num_copying_out=states.count(SlotState.COPYING_OUT),
            num_copying_in=states.count(SlotState.COPYING_IN),
            lookup_blocks=self._lookup_blocks,
            hit_blocks=self._hit_blocks,
            blocks_copied_out=self._copied_out,
            blocks_copied_in=self._copied_in,
            evictions=self._evictions,
            dropped_offers=self._dropped,
            load_wait_steps=self._load_wait_steps,
        )

    def check_integrity(self) -> None:
        """Raise :class:`BlockPoolError` if an invariant is broken (O(slots); for tests)."""
        used = set(self._by_slot)
        free = set(self._free)
        if len(free) != len(self._free) or used & free or len(used) + len(free) != self.num_slots:
            raise BlockPoolError("every slot must be either free or used, exactly once")
        if len(self._by_digest) != len(self._by_slot):
            raise BlockPoolError("a hash is held by two slots")
        for slot, entry in self._by_slot.items():
            if entry.slot != slot or self._by_digest.get(entry.digest) is not entry:
                raise BlockPoolError(f"{entry!r} is indexed under the wrong slot or hash")
            if (entry.state is SlotState.RESIDENT) != (slot in self._lru):
                raise BlockPoolError(f"{entry!r}: LRU membership disagrees with its state")

    # ---------------------------------------------------------------- private
    def _expect(self, slot: int, state: SlotState) -> TierEntry:
        entry = self.entry(slot)
        if entry.state is not state:
            raise BlockPoolError(f"{entry!r} is not {state.value}")
        return entry

    def _release(self, entry: TierEntry) -> None:
        del self._by_slot[entry.slot]
        del self._by_digest[entry.digest]
        self._free.append(entry.slot)
