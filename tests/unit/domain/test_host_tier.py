"""The host KV tier's index: slots, LRU eviction, the chain continued from the device."""

from __future__ import annotations

import pytest

from pagedinfer.domain.hashing import chain_hashes
from pagedinfer.domain.host_tier import HostTier, SlotState
from pagedinfer.errors import BlockPoolError

SIZE = 2


def resident(tier: HostTier, digest: int, parent: int | None, tokens: list[int]) -> int:
    slot = tier.offer(digest, parent, tokens)
    assert slot is not None
    tier.copied_out(slot)
    return slot


def test_a_full_tier_evicts_its_least_recently_used_block() -> None:
    tier = HostTier(2, SIZE)
    a = resident(tier, 1, None, [1, 1])
    resident(tier, 2, None, [2, 2])
    assert tier.offer(1, None, [1, 1]) is None  # known: refreshed, not copied again
    slot = tier.offer(3, None, [3, 3])  # full: the block of hash 2 goes
    assert slot is not None and slot != a
    assert tier.contains(1) and not tier.contains(2) and tier.contains(3)
    stats = tier.stats()
    assert (stats.evictions, stats.num_resident, stats.num_copying_out) == (1, 1, 1)
    assert stats.num_used_slots == stats.num_slots == 2
    tier.check_integrity()


def test_slots_in_flight_are_never_evicted_nor_found() -> None:
    tier = HostTier(1, SIZE)
    slot = tier.offer(1, None, [1, 1])
    assert slot is not None
    assert tier.find([1], [1, 1], 0, None) == []  # its copy out has not landed
    assert tier.offer(2, None, [2, 2]) is None  # every slot in flight: dropped
    assert tier.stats().dropped_offers == 1
    tier.copied_out(slot)
    (entry,) = tier.find([1], [1, 1], 0, None)
    tier.take([entry])
    assert entry.state is SlotState.COPYING_IN
    assert tier.offer(2, None, [2, 2]) is None  # pinned for its copy in
    tier.give_back(slot)  # the request went away: resident again
    assert tier.find([1], [1, 1], 0, None) == [entry]
    tier.take([entry])
    tier.copied_in(slot)  # exclusive: the block lives on the device now
    assert not tier.contains(1) and tier.stats().blocks_copied_in == 1
    tier.check_integrity()


def test_lookup_continues_the_device_chain_and_checks_tokens() -> None:
    tokens = [5, 6, 7, 8, 9, 10]
    hashes = chain_hashes(tokens, SIZE)
    tier = HostTier(4, SIZE)
    resident(tier, hashes[1], hashes[0], tokens[2:4])
    resident(tier, hashes[2], hashes[1], tokens[4:6])
    found = tier.find(hashes, tokens, 1, hashes[0])  # block 0 was found on the device
    assert [entry.digest for entry in found] == hashes[1:]
    assert tier.find(hashes, tokens, 0, None) == []  # a chain only matches from its start
    assert tier.find(hashes, tokens, 1, 12345) == []  # wrong parent: a collision guard
    other = [5, 6, 7, 99, 9, 10]
    assert tier.find(hashes, other, 1, hashes[0]) == []  # stored tokens differ


def test_bad_calls_raise_and_change_nothing() -> None:
    tier = HostTier(1, SIZE)
    with pytest.raises(BlockPoolError, match="only full blocks"):
        tier.offer(1, None, [1])
    with pytest.raises(BlockPoolError, match="holds nothing"):
        tier.copied_out(0)
    slot = resident(tier, 1, None, [1, 1])
    with pytest.raises(BlockPoolError, match="not copying_in"):
        tier.copied_in(slot)
    with pytest.raises(BlockPoolError, match=">= 1"):
        HostTier(0, SIZE)
    tier.check_integrity()
    assert tier.stats().num_resident == 1
