"""BlockPool's smallest block: one token (zero is refused: test_block_pool.py)."""

from __future__ import annotations

from pagedinfer.domain.block_pool import BlockPool


def test_a_block_of_one_token_is_the_smallest_block() -> None:
    pool = BlockPool(num_blocks=2, block_size=1)
    assert pool.block_size == 1
    assert [block.block_id for block in pool.allocate(2)] == [0, 1]
    assert pool.num_free_blocks == 0
