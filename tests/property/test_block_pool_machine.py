"""Stateful property test of BlockPool against a plain model of who holds which block.

The model keeps, outside the pool: the live block tables (what sequences hold), what each
block was registered with, and the order free blocks will be reused in. Every rule checks
the pool's answer against the model; the invariants check the whole state after each step.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedinfer.domain import BlockPool, block_hash, chain_hashes
from pagedinfer.errors import BlockPoolError

# A tiny alphabet makes equal blocks (shared prefixes, duplicate copies) common.
TOKENS = st.integers(0, 2)


@dataclass
class Table:
    """One holder's view: the blocks it holds and the tokens they stand for."""

    block_ids: list[int]
    tokens: list[int]  # len(block_ids) * block_size tokens
    extra_key: int | None


# (hash, parent hash, tokens) a block was registered with.
Meta = tuple[int, int | None, tuple[int, ...]]


class BlockPoolMachine(RuleBasedStateMachine):
    pool: BlockPool

    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.sampled_from([True, True, True, False]),  # mostly on: that is the hard part
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=caching)
        self.size = block_size
        self.caching = caching
        self.tables: list[Table] = []
        self.meta: dict[int, Meta] = {}
        self.impostors: set[int] = set()  # registered on purpose under a wrong hash
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.free_cached: list[int] = []  # least recently freed first
        self.query_tokens = 0
        self.hit_tokens = 0

    # ------------------------------------------------------------------ model helpers
    def model_refs(self) -> Counter[int]:
        return Counter(block_id for table in self.tables for block_id in table.block_ids)

    def expected_allocation(self, count: int) -> list[int]:
        order = list(self.free_uncached) + self.free_cached
        return order[:count]

    def take_free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if block_id in self.free_cached:
                self.free_cached.remove(block_id)
            else:
                self.free_uncached.remove(block_id)

    def find_candidates(
        self, index: int, digest: int, parent: int | None, tokens: list[int]
    ) -> list[int]:
        expected = tuple(tokens[index * self.size : (index + 1) * self.size])
        return [b for b, m in self.meta.items() if m == (digest, parent, expected)]

    def table_tokens(self, prefix: list[int], num_blocks: int) -> list[int]:
        tokens = (prefix * (num_blocks * self.size + 1))[: num_blocks * self.size]
        return tokens if prefix else [0] * (num_blocks * self.size)

    # -------------------------------------------------------------------------- rules
    @rule(
        count=st.integers(0, 3) | st.integers(0, 14),
        prefix=st.lists(TOKENS, max_size=12),
        extra_key=st.none() | st.just(7),
        register_now=st.booleans(),
    )
    def allocate(
        self, count: int, prefix: list[int], extra_key: int | None, register_now: bool
    ) -> None:
        free_before = self.pool.num_free_blocks
        if count > free_before:
            with pytest.raises(BlockPoolError):
                self.pool.allocate(count)
            return  # the invariants check that nothing changed
        expected = self.expected_allocation(count)
        refs = self.model_refs()
        blocks = self.pool.allocate(count)
        got = [block.block_id for block in blocks]
        assert got == expected, f"allocation order {got}, expected {expected}"
        assert len(set(got)) == len(got)
        assert all(refs[block_id] == 0 for block_id in got), "a live block was handed out"
        assert all(block.ref_count == 1 and block.hash is None for block in blocks)
        if any(block_id in self.meta for block_id in got):
            event("allocate evicted a cached block")
        self.take_free(got)
        for block_id in got:  # evicted from the prefix cache
            self.meta.pop(block_id, None)
            self.impostors.discard(block_id)
        self.tables.append(Table(got, self.table_tokens(prefix, count), extra_key))
        if register_now:
            self.register(len(self.tables) - 1, count)

    @rule(
        prefix=st.lists(TOKENS, max_size=12),
        num_blocks=st.integers(1, 6),
        extra=st.integers(0, 3),
        extra_key=st.none() | st.just(7),
        copy_from=st.integers(0, 100) | st.none(),
        register_now=st.booleans(),
    )
    def share(
        self,
        prefix: list[int],
        num_blocks: int,
        extra: int,
        extra_key: int | None,
        copy_from: int | None,
        register_now: bool,
    ) -> None:
        """Admission: look a prefix up, acquire the hits, allocate the rest."""
        if copy_from is not None and self.tables:
            source = self.tables[copy_from % len(self.tables)]
            tokens, extra_key = list(source.tokens), source.extra_key
            tokens += self.table_tokens(prefix, extra)
            num_blocks = len(tokens) // self.size
        else:
            tokens = self.table_tokens(prefix, num_blocks)
        if num_blocks == 0:
            return
        hashes = chain_hashes(tokens, self.size, extra_key)
        found = self.pool.find_cached_prefix(hashes, tokens)
        # Check the hits against the model: right content, maximal, in-use copies first.
        refs = self.model_refs()
        parent: int | None = None
        for index, block in enumerate(found):
            candidates = self.find_candidates(index, hashes[index], parent, tokens)
            assert block.block_id in candidates, f"hit {block!r} is not a valid copy"
            if any(refs[c] > 0 for c in candidates):
                assert refs[block.block_id] > 0, "a free copy was picked over one in use"
            parent = hashes[index]
        if not self.caching:
            assert found == []
        elif len(found) < len(hashes):
            assert not self.find_candidates(len(found), hashes[len(found)], parent, tokens), (
                "the lookup stopped before the first miss"
            )
        hit_ids = [block.block_id for block in found]
        if found:
            event("share: prefix hit")
        if len({self.meta[b][0] for b in self.meta}) < len(self.meta):
            event("index holds duplicate copies")
        cost = self.pool.cost_of_acquiring(found)
        assert cost == sum(1 for block_id in hit_ids if refs[block_id] == 0)
        missing = num_blocks - len(found)
        self.pool.record_prefix_lookup(len(tokens), len(found) * self.size)
        self.query_tokens += len(tokens)
        self.hit_tokens += len(found) * self.size
        if cost + missing > self.pool.num_free_blocks:
            return  # not admitted; nothing acquired
        free_before = self.pool.num_free_blocks
        self.pool.acquire(found)
        assert self.pool.num_free_blocks == free_before - cost
        self.take_free([block_id for block_id in hit_ids if refs[block_id] == 0])
        expected = self.expected_allocation(missing)
        new_ids = [block.block_id for block in self.pool.allocate(missing)]
        assert new_ids == expected
        self.take_free(new_ids)
        for block_id in new_ids:
            self.meta.pop(block_id, None)
            self.impostors.discard(block_id)
        self.tables.append(Table(hit_ids + new_ids, tokens, extra_key))
        if register_now:
            self.register(len(self.tables) - 1, num_blocks)

    @precondition(lambda self: self.tables)
    @rule(which=st.integers(0, 100), upto=st.integers(1, 6))
    def register_blocks(self, which: int, upto: int) -> None:
        self.register(which, upto)

    def register(self, which: int, upto: int) -> None:
        """Register the table's first ``upto`` blocks that are not registered yet."""
        table = self.tables[which % len(self.tables)]
        hashes = chain_hashes(table.tokens, self.size, table.extra_key)
        for index, block_id in enumerate(table.block_ids[:upto]):
            parent = hashes[index - 1] if index else None
            chunk = table.tokens[index * self.size : (index + 1) * self.size]
            if self.pool.block(block_id).hash is not None:
                with pytest.raises(BlockPoolError):
                    self.pool.register(block_id, hashes[index], parent, chunk)
                continue
            self.pool.register(block_id, hashes[index], parent, chunk)
            if self.caching:
                self.meta[block_id] = (hashes[index], parent, tuple(chunk))

    @precondition(lambda self: self.tables)
    @rule(
        which=st.integers(0, 100),
        index=st.integers(0, 5),
        other=st.lists(TOKENS, max_size=4),
        wrong_parent=st.booleans(),
    )
    def register_collision(
        self, which: int, index: int, other: list[int], wrong_parent: bool
    ) -> None:
        """Force a hash collision: a block stored under the hash of other content.

        Either its tokens differ from the content the hash stands for, or its tokens are
        right but it claims a parent, which a first block of a chain cannot have.
        """
        table = self.tables[which % len(self.tables)]
        if not table.block_ids:
            return
        index %= len(table.block_ids)
        block_id = table.block_ids[index]
        if self.pool.block(block_id).hash is not None:
            return
        genuine = (other * self.size + [1] * self.size)[: self.size]
        digest = block_hash(genuine, None)
        if wrong_parent:
            parent: int | None = digest ^ 1
            stored = genuine
        else:
            parent = None
            stored = table.tokens[index * self.size : (index + 1) * self.size]
            if stored == genuine:
                return  # not a collision
        self.pool.register(block_id, digest, parent, stored)
        if self.caching:
            self.meta[block_id] = (digest, parent, tuple(stored))
            self.impostors.add(block_id)
        # The guard: a lookup of the genuine first block never returns the impostor.
        found = self.pool.find_cached_prefix([digest], genuine)
        assert block_id not in [block.block_id for block in found]

    @precondition(lambda self: self.tables)
    @rule(which=st.integers(0, 100))
    def free(self, which: int) -> None:
        table = self.tables.pop(which % len(self.tables))
        self.pool.free(table.block_ids[::-1])  # tail first, as sequences do
        refs = self.model_refs()
        for block_id in table.block_ids[::-1]:
            if refs[block_id] == 0:
                if block_id in self.meta:
                    self.free_cached.append(block_id)
                else:
                    self.free_uncached.append(block_id)

    @rule(block_id=st.integers(-2, 14), times=st.integers(1, 3))
    def bad_free(self, block_id: int, times: int) -> None:
        """Free more references than exist, or an unknown id: raises, changes nothing."""
        refs = self.model_refs()
        if 0 <= block_id < self.pool.num_blocks and refs[block_id] >= times:
            return  # that would be a legal free
        with pytest.raises(BlockPoolError):
            self.pool.free([block_id] * times)
        event("refused a bad free")

    @precondition(lambda self: self.tables)
    @rule(which=st.integers(0, 100), block_id=st.integers(0, 13))
    def free_table_plus_a_bad_id(self, which: int, block_id: int) -> None:
        """A legal free with one illegal id appended is refused as a whole."""
        table = self.tables[which % len(self.tables)]
        refs = self.model_refs()
        if 0 <= block_id < self.pool.num_blocks and refs[block_id] > table.block_ids.count(
            block_id
        ):
            return
        with pytest.raises(BlockPoolError):
            self.pool.free([*table.block_ids[::-1], block_id])

    @rule(dice=st.integers(0, 9))
    def reset_prefix_cache(self, dice: int) -> None:
        if dice:
            return  # rarely: a reset wipes out the state the other rules build up
        self.pool.reset_prefix_cache()
        self.meta.clear()
        self.impostors.clear()
        self.free_uncached.extend(self.free_cached)
        self.free_cached.clear()

    def teardown(self) -> None:
        event(f"steps: {self.steps // 10 * 10}+")

    # --------------------------------------------------------------------- invariants
    @invariant()
    def integrity(self) -> None:
        self.steps = getattr(self, "steps", -1) + 1
        self.pool.check_integrity()

    @invariant()
    def ref_counts_match_live_tables(self) -> None:
        refs = self.model_refs()
        for block_id in range(self.pool.num_blocks):
            block = self.pool.block(block_id)
            assert block.ref_count == refs[block_id], f"{block!r} held {refs[block_id]} times"

    @invariant()
    def free_iff_unreferenced(self) -> None:
        refs = self.model_refs()
        unreferenced = sum(1 for b in range(self.pool.num_blocks) if refs[b] == 0)
        assert self.pool.num_free_blocks == unreferenced
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.pool.num_blocks
        assert len(self.free_uncached) + len(self.free_cached) == unreferenced

    @invariant()
    def index_entries_match_their_content(self) -> None:
        for block_id in range(self.pool.num_blocks):
            block = self.pool.block(block_id)
            expected = self.meta.get(block_id)
            if expected is None:
                assert block.hash is None, f"{block!r} should not be in the prefix cache"
                continue
            assert (block.hash, block.parent_hash, block.token_ids) == expected
            if block_id not in self.impostors:
                assert block.hash == block_hash(block.token_ids, block.parent_hash) or (
                    block.parent_hash is None
                    and block.hash == block_hash(block.token_ids, None, extra_key=7)
                )

    @invariant()
    def stats_add_up(self) -> None:
        stats = self.pool.stats()
        assert stats.num_blocks == self.pool.num_blocks
        assert stats.num_free_blocks + stats.num_used_blocks == stats.num_blocks
        assert stats.num_cached_blocks == len(self.meta)
        assert stats.usage == pytest.approx(stats.num_used_blocks / stats.num_blocks)
        assert stats.prefix_query_tokens == self.query_tokens
        assert stats.prefix_hit_tokens == self.hit_tokens
        assert stats.prefix_hit_tokens <= stats.prefix_query_tokens


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings.get_profile("pagedinfer-property")
