"""Chained block hashing: the keys of the prefix cache.

``h_i = xxh64( h_{i-1} as 8 bytes little-endian (only when i > 0) ‖ token ids of block i as
int64 little-endian )``, digest read as an unsigned int. This is bit-compatible with
nano-vLLM's ``BlockManager.compute_hash`` (which hashes ``np.array(token_ids).tobytes()``),
pinned by known vectors in the tests. Because each hash covers its parent's, equal hashes
mean equal prefixes (up to xxh64 collisions, which the block pool guards against by comparing
stored token ids and parent hashes).

``extra_key`` separates requests that must never share KV (a cache salt, an adapter id): it
enters the hash of block 0 (as the xxh64 seed *and* as 8 leading bytes, so that
``extra_key=0`` differs from no key) and therefore changes the whole chain. It is taken
modulo 2**64.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

__all__ = ["block_hash", "chain_hashes", "extend_chain"]

_NEEDS_BYTESWAP = sys.byteorder != "little"
_UINT64_MASK = (1 << 64) - 1


def _int64_le_bytes(token_ids: Sequence[int]) -> bytes:
    packed = array("q", token_ids)
    if _NEEDS_BYTESWAP:
        packed.byteswap()
    return packed.tobytes()


def block_hash(
    token_ids: Sequence[int], parent_hash: int | None, extra_key: int | None = None
) -> int:
    """Hash one full block given its parent's hash (``None`` for block 0).

    ``extra_key`` only affects block 0; later blocks inherit it through their parent hash.
    """
    if parent_hash is not None:
        hasher = xxhash.xxh64()
        hasher.update(parent_hash.to_bytes(8, "little"))
    elif extra_key is not None:
        # A seed alone would make extra_key=0 collide with "no key" (seed 0 is the default).
        key = extra_key & _UINT64_MASK
        hasher = xxhash.xxh64(seed=key)
        hasher.update(key.to_bytes(8, "little"))
    else:
        hasher = xxhash.xxh64()
    hasher.update(_int64_le_bytes(token_ids))
    return hasher.intdigest()


def extend_chain(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    extra_key: int | None = None,
) -> list[int]:
    """Append to ``hashes`` (the chain of the first blocks) until it covers ``num_blocks``.

    Only the missing blocks are hashed, so calling this every step costs O(new blocks).
    ``num_blocks`` must not exceed the number of full blocks in ``token_ids``.
    """
    parent = hashes[-1] if hashes else None
    for index in range(len(hashes), num_blocks):
        start = index * block_size
        parent = block_hash(token_ids[start : start + block_size], parent, extra_key)
        hashes.append(parent)
    return hashes


def chain_hashes(
    token_ids: Sequence[int], block_size: int, extra_key: int | None = None
) -> list[int]:
    """Hashes of every *full* block of ``token_ids``; a trailing partial block is not hashed."""
    return extend_chain([], token_ids, block_size, len(token_ids) // block_size, extra_key)
