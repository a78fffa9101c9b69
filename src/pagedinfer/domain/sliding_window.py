"""What a sliding-window group still sees: the block arithmetic of a window.

With window ``w`` the query at position ``p`` sees the keys at ``p - w + 1 .. p``. Once a
sequence's first ``c`` tokens are computed, every later query is at ``c`` or after, so the
blocks wholly before ``c - w + 1`` are never read again: the group frees them and points
their table entries to the null block (:mod:`pagedinfer.domain.kv_groups`).

Prefix caching follows vLLM's rule: a sliding group can serve the first ``k`` blocks of a
prompt from the cache when the blocks of the *last window* before that point are cached
(the ones before it are never read); the hit is the longest such ``k``.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["first_visible_block", "longest_window_hit", "max_live_blocks"]


def first_visible_block(num_computed: int, window: int, block_size: int) -> int:
    """The first block a query at position ``num_computed`` (or later) can see."""
    return max(num_computed - window + 1, 0) // block_size


def max_live_blocks(window: int, block_size: int, num_tokens: int = 1) -> int:
    """The most blocks a sliding group holds for one sequence whose out-of-window blocks
    were freed at its computed count ``c``, while a step writes ``num_tokens`` from ``c``:
    those covering ``c - w + 1 .. c + num_tokens - 1``. With one token (a decode step)
    that is at most ``ceil(w / block_size) + 1``."""
    span = window - 1 + num_tokens
    return -(-span // block_size) + 1


def longest_window_hit(
    is_cached: Callable[[int], bool], max_blocks: int, window: int, block_size: int
) -> int:
    """The largest ``k <= max_blocks`` whose blocks ``first_visible_block(k * block_size)
    .. k - 1`` all satisfy ``is_cached`` (0 always qualifies: nothing to find)."""
    run = [0] * max_blocks  # run[i]: cached blocks ending at block i, contiguous
    length = 0
    for index in range(max_blocks):
        length = length + 1 if is_cached(index) else 0
        run[index] = length
    for k in range(max_blocks, 0, -1):
        if run[k - 1] >= k - first_visible_block(k * block_size, window, block_size):
            return k
    return 0
