"""Chained block hashes: bit-compatible with nano-vLLM, full blocks only, salted by extra_key."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from pagedinfer.domain import BlockPool, block_hash, chain_hashes, extend_chain


def nano_vllm_compute_hash(token_ids: list[int], prefix: int = -1) -> int:
    """nano-vLLM's ``BlockManager.compute_hash``, verbatim in behaviour."""
    hasher = xxhash.xxh64()
    if prefix != -1:
        hasher.update(prefix.to_bytes(8, "little"))
    hasher.update(np.array(token_ids).tobytes())
    return hasher.intdigest()


# Computed once with the formula above (numpy int64 arrays, xxhash 3.x); never recompute
# these from our own code, or the test could not catch a change of formula.
KNOWN_VECTORS: list[tuple[list[int], int | None, int]] = [
    ([1, 2, 3, 4], None, 8356527653647720045),
    ([5, 6, 7, 8], 8356527653647720045, 610383040053763902),
    ([0], None, 3803688792395291579),
    ([151643, 9707, 11, 1879], None, 18051606577195298737),
    ([9, 9, 9, 9], 0, 183261429169625278),
    ([1, 2, 3, 4], 12345678901234567890, 3019816505522235369),
]


@pytest.mark.parametrize(("token_ids", "parent", "expected"), KNOWN_VECTORS)
def test_known_vectors(token_ids: list[int], parent: int | None, expected: int) -> None:
    assert block_hash(token_ids, parent) == expected


@pytest.mark.parametrize(("token_ids", "parent", "expected"), KNOWN_VECTORS)
def test_known_vectors_match_the_nano_vllm_formula(
    token_ids: list[int], parent: int | None, expected: int
) -> None:
    # Guards the vectors themselves: they are what nano-vLLM computes.
    assert nano_vllm_compute_hash(token_ids, -1 if parent is None else parent) == expected


# Block 0 under an extra_key: xxh64 seeded with the key (mod 2**64) over the key as 8
# little-endian bytes, then the tokens as int64 little-endian. Computed once with struct and
# xxhash from that definition (like KNOWN_VECTORS, never from our own code).
EXTRA_KEY_VECTORS: list[tuple[list[int], int, int]] = [
    ([1, 2, 3, 4], 5, 9595305333213610941),
    ([1, 2, 3, 4], 0, 14376776624401366104),
    ([7, 8], -1, 14498806329400383051),
    ([151643, 9707], 2**64 + 3, 78851339244910896),
]


@pytest.mark.parametrize(("token_ids", "extra_key", "expected"), EXTRA_KEY_VECTORS)
def test_known_vectors_with_an_extra_key(
    token_ids: list[int], extra_key: int, expected: int
) -> None:
    assert block_hash(token_ids, None, extra_key) == expected
    assert chain_hashes(token_ids, len(token_ids), extra_key) == [expected]


def test_chain_of_known_vectors() -> None:
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], block_size=4) == [
        8356527653647720045,
        610383040053763902,
    ]


@given(
    token_ids=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=64),
    parent=st.none() | st.integers(0, 2**64 - 1),
)
def test_block_hash_equals_nano_vllm_on_random_blocks(
    token_ids: list[int], parent: int | None
) -> None:
    expected = nano_vllm_compute_hash(token_ids, -1 if parent is None else parent)
    assert block_hash(token_ids, parent) == expected


@given(
    token_ids=st.lists(st.integers(0, 200_000), max_size=80),
    block_size=st.integers(1, 17),
)
def test_chain_equals_nano_vllm_chain(token_ids: list[int], block_size: int) -> None:
    expected: list[int] = []
    prefix = -1
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prefix = nano_vllm_compute_hash(token_ids[start : start + block_size], prefix)
        expected.append(prefix)
    assert chain_hashes(token_ids, block_size) == expected


def test_digests_are_unsigned_64_bit() -> None:
    for token_ids, parent, _ in KNOWN_VECTORS:
        assert 0 <= block_hash(token_ids, parent) < 2**64


def test_partial_blocks_are_never_hashed() -> None:
    assert chain_hashes([1, 2, 3], block_size=4) == []
    assert chain_hashes([], block_size=4) == []
    full = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], block_size=4) == full
    assert len(chain_hashes(list(range(9)), block_size=4)) == 2


def test_each_hash_covers_its_whole_prefix() -> None:
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    b = chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    # Same second block, different first block: the second hashes differ too.
    assert a[0] != b[0]
    assert a[1] != b[1]


def test_the_same_block_under_different_parents_differs() -> None:
    assert block_hash([5, 6], None) != block_hash([5, 6], 1) != block_hash([5, 6], 2)


def test_block_size_changes_the_chain() -> None:
    tokens = list(range(8))
    assert chain_hashes(tokens, 2)[1] != chain_hashes(tokens, 4)[0]


def test_extra_key_changes_every_hash_of_the_chain() -> None:
    tokens = list(range(12))
    plain = chain_hashes(tokens, block_size=4)
    salted = chain_hashes(tokens, block_size=4, extra_key=42)
    other = chain_hashes(tokens, block_size=4, extra_key=43)
    assert len(plain) == len(salted) == len(other) == 3
    for a, b, c in zip(plain, salted, other, strict=True):
        assert len({a, b, c}) == 3


@pytest.mark.parametrize("extra_key", [0, 1, -1, 2**63, 2**64 - 1])
def test_any_extra_key_differs_from_no_key(extra_key: int) -> None:
    # An adapter id of 0 must not share KV with the base model.
    tokens = [7, 8, 9, 10]
    assert chain_hashes(tokens, 4, extra_key=extra_key) != chain_hashes(tokens, 4)


def test_extra_key_only_enters_through_block_zero() -> None:
    tokens = list(range(8))
    salted = chain_hashes(tokens, block_size=4, extra_key=99)
    # Later blocks inherit the salt through their parent: hashing block 1 with the salted
    # parent and with or without the key gives the same digest.
    assert block_hash(tokens[4:], salted[0], extra_key=99) == salted[1]
    assert block_hash(tokens[4:], salted[0]) == salted[1]


def test_extend_chain_hashes_only_missing_blocks() -> None:
    tokens = list(range(10))
    hashes = extend_chain([], tokens, block_size=2, num_blocks=2)
    assert hashes == chain_hashes(tokens[:4], 2)
    same = extend_chain(hashes, tokens, block_size=2, num_blocks=4)
    assert same is hashes  # extended in place
    assert hashes == chain_hashes(tokens[:8], 2)
    # Asking for fewer blocks than already hashed leaves the chain alone.
    assert extend_chain(hashes, tokens, block_size=2, num_blocks=1) == chain_hashes(tokens[:8], 2)


def test_extend_chain_trusts_existing_prefix() -> None:
    # Only missing blocks are hashed: a (bogus) existing entry is used as the parent as is.
    tokens = [1, 2, 3, 4]
    hashes = extend_chain([123], tokens, block_size=2, num_blocks=2)
    assert hashes == [123, block_hash([3, 4], 123)]


def test_extend_chain_keeps_extra_key_consistent() -> None:
    tokens = list(range(12))
    stepwise = extend_chain([], tokens, 4, 1, extra_key=5)
    extend_chain(stepwise, tokens, 4, 3, extra_key=5)
    assert stepwise == chain_hashes(tokens, 4, extra_key=5)


def test_tuple_and_list_inputs_hash_alike() -> None:
    assert block_hash((1, 2, 3), None) == block_hash([1, 2, 3], None)
    assert chain_hashes(range(8), 4) == chain_hashes(list(range(8)), 4)


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
