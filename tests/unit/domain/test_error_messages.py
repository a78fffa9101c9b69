"""Every error the domain raises for a caller's mistake, with its exact message.

The messages are part of the interface (they say what was wrong, what is allowed and how
to fix it); tests elsewhere match a fragment, these pin the whole text, so a message that
loses its numbers or its advice fails here. Also the boundaries of the checks that raise
them: the largest accepted value next to the smallest refused one.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedinfer.domain import (
    BlockPool,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
)
from pagedinfer.domain.block_pool import Block
from pagedinfer.errors import BlockPoolError, ConfigurationError, InvalidRequestError


def pool_with_one_used() -> BlockPool:
    pool = BlockPool(3, 4)
    pool.allocate(1)
    return pool


def scheduler(**fields: int) -> Scheduler:
    values = {"num_blocks": 8, "block_size": 4, "max_model_len": 16, "max_num_seqs": 4}
    values.update(fields)
    return Scheduler(SchedulerConfig(**values))  # type: ignore[arg-type]


def not_fresh(seq: Sequence, how: str) -> Sequence:
    """``seq`` as it looks once a scheduler has touched it (each field on its own)."""
    if how == "slot 0":
        seq.slot = 0
    elif how == "blocks":
        seq.block_table = [1]
    else:
        seq.status = SequenceStatus.RUNNING
    return seq


def add_with_forks(
    n: int,
    prompt: list[int],
    *,
    child_prompt: list[int] | None = None,
    child_id: int | None = None,
    child: str | None = None,
    **fields: int,
) -> Scheduler:
    sched = scheduler(**fields)
    children = [Sequence(i + 1, list(child_prompt or prompt)) for i in range(n - 1)]
    if child_id is not None:
        children[0].seq_id = child_id
    if child is not None:
        not_fresh(children[0], child)
    sched.add(Sequence(0, list(prompt)), forks=children)
    return sched


FRESHNESS = ["slot 0", "blocks", "status"]
REPR = "Sequence(id={}, status={}, tokens={}, computed=0, blocks={})"

CASES: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    (
        "pool: no blocks",
        lambda: BlockPool(0, 4),
        BlockPoolError,
        "num_blocks=0 is invalid: a pool needs >= 1 block.",
    ),
    (
        "pool: block size 0",
        lambda: BlockPool(4, 0),
        BlockPoolError,
        "block_size=0 is invalid: it must be >= 1.",
    ),
    (
        "pool: foreign block",
        lambda: pool_with_one_used().acquire([Block(0)]),
        BlockPoolError,
        "Block(id=0, ref=0, hash=None) is not a cached block of this pool.",
    ),
    (
        "pool: share a free block",
        lambda: pool_with_one_used().share([1]),
        BlockPoolError,
        "block 1 is free: only blocks in use are shared.",
    ),
    (
        "pool: allocate -1",
        lambda: pool_with_one_used().allocate(-1),
        BlockPoolError,
        "cannot allocate -1 blocks.",
    ),
    (
        "pool: allocate too many",
        lambda: pool_with_one_used().allocate(3),
        BlockPoolError,
        "cannot allocate 3 blocks: only 2 of 3 are free.",
    ),
    (
        "pool: double free",
        lambda: pool_with_one_used().free([0, 0]),
        BlockPoolError,
        "double free of block 0: its ref_count is 1.",
    ),
    (
        "pool: unknown block",
        lambda: pool_with_one_used().free([3]),
        BlockPoolError,
        "block id 3 is unknown: ids run from 0 to 2.",
    ),
    (
        "pool: register a free block",
        lambda: pool_with_one_used().register(1, 5, None, [1, 2, 3, 4]),
        BlockPoolError,
        "cannot register free block 1.",
    ),
    (
        "pool: register a partial block",
        lambda: pool_with_one_used().register(0, 5, None, [1, 2]),
        BlockPoolError,
        "only full blocks are cached: block 0 has 2 tokens, block_size is 4.",
    ),
    (
        "config: unknown policy",
        lambda: SchedulerConfig(num_blocks=8, scheduling_policy="fifo"),
        ConfigurationError,
        "scheduling_policy='fifo' is unknown: expected one of 'mixed', 'prefill_first' "
        "('mixed' runs prefill chunks alongside decode rows; 'prefill_first' runs them first).",
    ),
    (
        "config: no blocks",
        lambda: SchedulerConfig(num_blocks=0),
        ConfigurationError,
        "num_blocks=0 is invalid: expected an integer >= 1.",
    ),
    (
        "config: max_model_len 1",
        lambda: SchedulerConfig(num_blocks=8, max_model_len=1),
        ConfigurationError,
        "max_model_len=1 is invalid: expected an integer >= 2 (one prompt token plus one "
        "generated token).",
    ),
    (
        "config: pool smaller than a sequence",
        lambda: SchedulerConfig(num_blocks=2, block_size=4, max_model_len=9),
        ConfigurationError,
        "the KV pool holds 8 tokens (2 blocks x 4) but max_model_len is 9: the pool must hold "
        "at least one max_model_len sequence. Give it more blocks (more memory, num_kv_blocks) "
        "or lower max_model_len.",
    ),
    (
        "scheduler: mismatched pool",
        lambda: Scheduler(
            SchedulerConfig(num_blocks=8, block_size=4, max_model_len=16), BlockPool(8, 2)
        ),
        ConfigurationError,
        "the block pool does not match the scheduler config",
    ),
    (
        "add: empty prompt",
        lambda: scheduler().add(Sequence(0, [])),
        InvalidRequestError,
        "the prompt is empty: a request needs at least one token.",
    ),
    (
        "add: prompt too long",
        lambda: scheduler().add(Sequence(0, list(range(16)))),
        InvalidRequestError,
        "the prompt has 16 tokens; with the first generated token that exceeds "
        "max_model_len=16. Shorten the prompt to at most 15 tokens or raise max_model_len.",
    ),
    *[
        (
            f"add: not fresh ({how})",
            lambda how=how: scheduler().add(not_fresh(Sequence(0, [1, 2]), how)),
            InvalidRequestError,
            REPR.format(
                0,
                "running" if how == "status" else "waiting",
                2,
                [1] if how == "blocks" else [],
            )
            + " is not a fresh request.",
        )
        for how in FRESHNESS
    ],
    (
        "add: n too large",
        lambda: add_with_forks(5, [1, 2, 3]),
        InvalidRequestError,
        "n=5 completions cannot run at once: at most min(max_num_seqs, "
        "max_num_batched_tokens)=4 sequences run together. Lower n or raise max_num_seqs.",
    ),
    (
        "add: forks need too many blocks",
        lambda: add_with_forks(4, list(range(13)), num_blocks=6),
        InvalidRequestError,
        "the prompt and copies of its last block for n=4 completions need 7 KV blocks; the "
        "pool has 6. Lower n, shorten the prompt or give the KV cache more blocks.",
    ),
    (
        "add: a completion id used twice",
        lambda: add_with_forks(2, [1, 2, 3], child_id=0),
        InvalidRequestError,
        "request id 0 is used twice.",
    ),
    (
        "add: two completions with one id",
        lambda: add_with_forks(3, [1, 2, 3], child_id=2),
        InvalidRequestError,
        "request id 2 is used twice.",
    ),
    *[
        (
            f"add: completion not fresh ({how})",
            lambda how=how: add_with_forks(2, [1, 2, 3], child=how),
            InvalidRequestError,
            REPR.format(
                1,
                "running" if how == "status" else "waiting",
                3,
                [1] if how == "blocks" else [],
            )
            + " is not a fresh request.",
        )
        for how in FRESHNESS
    ],
    (
        "add: completions with another prompt",
        lambda: add_with_forks(2, [1, 2, 3], child_prompt=[1, 2, 4]),
        InvalidRequestError,
        "the completions of a request must share its prompt.",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_the_error_and_its_whole_message(
    call: Callable[[], object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error
    assert str(info.value) == message


def test_the_largest_accepted_values_next_to_the_refused_ones() -> None:
    SchedulerConfig(num_blocks=1, block_size=2, max_model_len=2)  # max_model_len 2: allowed
    scheduler().add(Sequence(0, list(range(15))))  # 15 tokens + 1 generated = max_model_len
    # n equal to max_running (4) and forks needing exactly the pool's blocks (4 + 3 = 7).
    add_with_forks(4, list(range(13)), num_blocks=7)
    # A prompt that fills its last block: the forks copy nothing, so 3 blocks suffice for
    # n=4 (with a copy per fork it would need 6).
    add_with_forks(4, list(range(12)), num_blocks=4)
