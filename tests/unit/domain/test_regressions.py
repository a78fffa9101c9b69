"""Bugs the test suites found in the domain layer, pinned as plain tests.

Each test names the bug it guards against; keep them even when they look redundant.
"""

from __future__ import annotations

from pagedinfer.domain import BlockPool, chain_hashes


def test_extra_key_zero_does_not_share_kv_with_no_key() -> None:
    # Bug: extra_key only seeded xxh64, and seed 0 is the default, so extra_key=0 (say,
    # adapter id 0) produced the same chain as no key and shared KV with the base model.
    tokens = [7, 8, 9, 10]
    assert chain_hashes(tokens, 4, extra_key=0) != chain_hashes(tokens, 4)
    pool = BlockPool(2, 4)
    (block,) = pool.allocate(1)
    (digest,) = chain_hashes(tokens, 4)
    pool.register(block.block_id, digest, None, tokens)
    assert pool.find_cached_prefix(chain_hashes(tokens, 4, extra_key=0), tokens) == []
