"""Block pool and scheduler micro-benchmarks (pure Python: no torch, no GPU).

Part 1, the block pool. Per pool size (1k to 1M blocks) and per workload, the cost of one
block operation, for :class:`pagedinfer.domain.BlockPool` and, side by side in the same run,
for a minimal re-implementation of nano-vLLM's ``BlockManager`` bookkeeping (a ``deque`` free
list; a prefix-cache hit on a free block calls ``deque.remove``, which scans the deque).
Workloads (chains of 4 blocks of 16 tokens; one op = one block):

* ``alloc+free``: allocate a chain's blocks, free them; no prefix cache involved.
* ``alloc(evict)+register+free``: every free block carries a hash, so each allocation evicts
  the least recently freed cached block; the new blocks are registered, then freed.
* ``hit free cached``: shared prefixes whose blocks are cached but free: ``find_cached_prefix``
  + ``acquire`` + ``free``. This is where nano-vLLM pays O(pool) per block.
* ``hit free cached, hot``: the same, but always among the same 256 chains (1,024 blocks).
  Against the row above it separates the cost of the algorithm from the cost of touching
  random memory in a large pool (cache misses; see docs/benchmarks.md).
* ``hit in-use``: shared prefixes whose blocks are in use by other requests (ref count 2 <-> 1).

Part 2, the scheduler: ``schedule()`` + ``postprocess()`` time (sampling excluded) for
nano-vLLM's workload: 256 requests, prompt and output lengths uniform in [100, 1024], random
token ids < 10000, ``ignore_eos``, block_size 256.

    python benchmarks/block_pool.py            # full run, under a minute on 2 CPU cores
    python benchmarks/block_pool.py --quick    # seconds; a smoke test
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Run from a plain checkout (`python benchmarks/NAME.py` at the repository root, no install):
# this repository's src/ comes first on the import path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pagedinfer.domain import (
    Block,
    BlockPool,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from pagedinfer.domain import Sequence as DomainSequence

BLOCK_SIZE = 16
CHAIN_BLOCKS = 4
TOKENS = tuple(range(BLOCK_SIZE))  # every block holds these; the chain hash tells them apart
CHAIN_TOKENS = list(TOKENS) * CHAIN_BLOCKS
HOT_CHAINS = 256
WARMUP_CALLS = 20
ROUNDS = 5
# CPU time of this process: time other processes take on a shared machine is not counted
# (their effect on the CPU caches still is). Nothing here sleeps or waits on I/O.
CLOCK = time.process_time
_MASK64 = (1 << 64) - 1


def fake_hash(n: int) -> int:
    """A distinct 64-bit value per n (an odd-multiplier bijection): hashing is not measured."""
    return ((n + 1) * 0x9E3779B97F4A7C15) & _MASK64


# ----------------------------------------------------------------------------- baseline


class _NanoBlock:
    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: tuple[int, ...] = ()

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = ()


class DequeFreeListPool:
    """nano-vLLM's ``BlockManager`` bookkeeping, reduced to what the workloads touch.

    Free blocks live in a ``deque`` in the order they were freed; ``_allocate_block`` takes a
    block out with ``deque.remove(block_id)``, which is O(1) for the head (a fresh allocation)
    but O(position) for a cached block found by a prefix hit.
    """

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [_NanoBlock(block_id) for block_id in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    def _allocate_block(self, block_id: int) -> _NanoBlock:
        block = self.blocks[block_id]
        block.reset()
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block

    def allocate_new(self) -> int:
        return self._allocate_block(self.free_block_ids[0]).block_id

    def register(self, block_id: int, digest: int, token_ids: tuple[int, ...]) -> None:
        block = self.blocks[block_id]
        block.hash = digest
        block.token_ids = token_ids
        self.hash_to_block_id[digest] = block_id

    def lookup_acquire(self, hashes: Sequence[int], token_ids: Sequence[int]) -> list[int]:
        """nano-vLLM's ``allocate`` for the cached prefix: stop at the first miss."""
        found: list[int] = []
        for index, digest in enumerate(hashes):
            block_id = self.hash_to_block_id.get(digest, -1)
            expected = tuple(token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
            if block_id == -1 or self.blocks[block_id].token_ids != expected:
                break
            if block_id in self.used_block_ids:
                self.blocks[block_id].ref_count += 1
            else:
                self.register(self._allocate_block(block_id).block_id, digest, expected)
            found.append(block_id)
        return found

    def hold_all_cached(self) -> list[int]:
        """Benchmark setup: take one reference on every cached free block, in O(pool).

        (Going through ``lookup_acquire`` would cost O(pool) per block here.)
        """
        held = [block_id for block_id in self.free_block_ids if self.blocks[block_id].hash != -1]
        for block_id in held:
            self.blocks[block_id].ref_count = 1
            self.used_block_ids.add(block_id)
        self.free_block_ids = deque(
            block_id for block_id in self.free_block_ids if block_id not in self.used_block_ids
        )
        return held

    def free(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)


# ----------------------------------------------------------------------- pool workloads


@dataclass(frozen=True)
class PoolResult:
    num_blocks: int
    workload: str
    ours_ns: float  # per block op
    base_ns: float
    base_ops: int  # block ops the baseline managed within its time budget


def _time_ops(op: Callable[[], int], max_ops: int, budget_s: float) -> tuple[float, int]:
    """Per-op ns of ``op`` (which returns the block ops it did) and the ops timed.

    ``max_ops`` ops (or as many as ``budget_s`` allows) in ``ROUNDS`` rounds; the fastest
    round counts, so that other processes on a shared machine inflate the result less.
    """
    for _ in range(WARMUP_CALLS):  # let the interpreter specialize the code first
        op()
    best = float("inf")
    total = 0
    per_round = max(max_ops // ROUNDS, 1)
    for _ in range(ROUNDS):
        done = calls = 0
        deadline = time.perf_counter() + budget_s / ROUNDS
        start = CLOCK()
        while done < per_round:
            done += op()
            calls += 1
            if calls % 8 == 0 and time.perf_counter() > deadline:
                break
        best = min(best, (CLOCK() - start) / done * 1e9)
        total += done
    return best, total


def _chain_hashes(num_chains: int, first: int = 0) -> list[list[int]]:
    return [
        [fake_hash((first + chain) * CHAIN_BLOCKS + index) for index in range(CHAIN_BLOCKS)]
        for chain in range(num_chains)
    ]


def _warm_ours(pool: BlockPool, hashes: list[list[int]]) -> None:
    """Every block computed, registered and freed: all of them cached and free."""
    blocks = pool.allocate(pool.num_blocks)
    for chain, digests in enumerate(hashes):
        parent: int | None = None
        for index, digest in enumerate(digests):
            pool.register(blocks[chain * CHAIN_BLOCKS + index].block_id, digest, parent, TOKENS)
            parent = digest
    for chain in range(len(hashes)):
        ids = [
            block.block_id for block in blocks[chain * CHAIN_BLOCKS : (chain + 1) * CHAIN_BLOCKS]
        ]
        pool.free(ids[::-1])


def _warm_base(base: DequeFreeListPool, hashes: list[list[int]]) -> None:
    for digests in hashes:
        ids = [base.allocate_new() for _ in digests]
        for block_id, digest in zip(ids, digests, strict=True):
            base.register(block_id, digest, TOKENS)
        base.free(reversed(ids))


def bench_pool_size(
    num_blocks: int, max_ops: int, budget_s: float, rng: random.Random
) -> list[PoolResult]:
    num_chains = num_blocks // CHAIN_BLOCKS
    hashes = _chain_hashes(num_chains)
    fresh = iter(range(num_chains, 1 << 62))  # chain numbers for never-seen content
    pool = BlockPool(num_blocks, BLOCK_SIZE)
    base = DequeFreeListPool(num_blocks)
    results: dict[str, list[float | int]] = {}

    def record(name: str, ours: Callable[[], int], theirs: Callable[[], int]) -> None:
        ours_ns, _ = _time_ops(ours, max_ops, budget_s=3600.0)
        base_ns, base_ops = _time_ops(theirs, max_ops, budget_s)
        results[name] = [ours_ns, base_ns, base_ops]

    # 1. Plain allocate + free on a cold pool (no block carries a hash).
    def ours_alloc_free() -> int:
        blocks = pool.allocate(CHAIN_BLOCKS)
        pool.free([block.block_id for block in reversed(blocks)])
        return CHAIN_BLOCKS

    def base_alloc_free() -> int:
        ids = [base.allocate_new() for _ in range(CHAIN_BLOCKS)]
        base.free(reversed(ids))
        return CHAIN_BLOCKS

    record("alloc+free", ours_alloc_free, base_alloc_free)

    _warm_ours(pool, hashes)
    _warm_base(base, hashes)
    pool.check_integrity()

    # 2. Prefix hits on cached blocks that sit somewhere in the free list.
    def ours_hit_free() -> int:
        found = pool.find_cached_prefix(hashes[rng.randrange(num_chains)], CHAIN_TOKENS)
        if len(found) != CHAIN_BLOCKS or pool.cost_of_acquiring(found) != CHAIN_BLOCKS:
            raise RuntimeError("expected a full hit on free cached blocks")
        pool.acquire(found)
        pool.free([block.block_id for block in reversed(found)])
        return CHAIN_BLOCKS

    def base_hit_free() -> int:
        found = base.lookup_acquire(hashes[rng.randrange(num_chains)], CHAIN_TOKENS)
        if len(found) != CHAIN_BLOCKS:
            raise RuntimeError("expected a full hit on free cached blocks")
        base.free(reversed(found))
        return CHAIN_BLOCKS

    record("hit free cached", ours_hit_free, base_hit_free)
    pool.check_integrity()

    # 2b. The same with a hot set of chains whose size does not grow with the pool.
    hot = min(HOT_CHAINS, num_chains)

    def ours_hit_hot() -> int:
        found = pool.find_cached_prefix(hashes[rng.randrange(hot)], CHAIN_TOKENS)
        if len(found) != CHAIN_BLOCKS or pool.cost_of_acquiring(found) != CHAIN_BLOCKS:
            raise RuntimeError("expected a full hit on free cached blocks")
        pool.acquire(found)
        pool.free([block.block_id for block in reversed(found)])
        return CHAIN_BLOCKS

    def base_hit_hot() -> int:
        found = base.lookup_acquire(hashes[rng.randrange(hot)], CHAIN_TOKENS)
        if len(found) != CHAIN_BLOCKS:
            raise RuntimeError("expected a full hit on free cached blocks")
        base.free(reversed(found))
        return CHAIN_BLOCKS

    record("hit free cached, hot", ours_hit_hot, base_hit_hot)
    pool.check_integrity()

    # 3. Prefix hits on blocks other requests are using (every block held once).
    held: list[Block] = []
    for digests in hashes:
        found = pool.find_cached_prefix(digests, CHAIN_TOKENS)
        pool.acquire(found)
        held.extend(found)
    base_held = base.hold_all_cached()
    if len(held) != len(base_held) or len(held) != num_chains * CHAIN_BLOCKS:
        raise RuntimeError("warm-up did not cache every chain")

    def ours_hit_used() -> int:
        found = pool.find_cached_prefix(hashes[rng.randrange(num_chains)], CHAIN_TOKENS)
        if len(found) != CHAIN_BLOCKS or pool.cost_of_acquiring(found) != 0:
            raise RuntimeError("expected a full hit on blocks in use")
        pool.acquire(found)
        pool.free([block.block_id for block in reversed(found)])
        return CHAIN_BLOCKS

    def base_hit_used() -> int:
        found = base.lookup_acquire(hashes[rng.randrange(num_chains)], CHAIN_TOKENS)
        if len(found) != CHAIN_BLOCKS:
            raise RuntimeError("expected a full hit on blocks in use")
        base.free(reversed(found))
        return CHAIN_BLOCKS

    record("hit in-use", ours_hit_used, base_hit_used)
    pool.free([block.block_id for block in reversed(held)])
    base.free(reversed(base_held))
    pool.check_integrity()

    # 4. New content on a pool full of cached free blocks: every allocation evicts.
    def ours_evict() -> int:
        digests = _chain_hashes(1, next(fresh))[0]
        blocks = pool.allocate(CHAIN_BLOCKS)
        parent: int | None = None
        for block, digest in zip(blocks, digests, strict=True):
            pool.register(block.block_id, digest, parent, TOKENS)
            parent = digest
        pool.free([block.block_id for block in reversed(blocks)])
        return CHAIN_BLOCKS

    def base_evict() -> int:
        digests = _chain_hashes(1, next(fresh))[0]
        ids = [base.allocate_new() for _ in range(CHAIN_BLOCKS)]
        for block_id, digest in zip(ids, digests, strict=True):
            base.register(block_id, digest, TOKENS)
        base.free(reversed(ids))
        return CHAIN_BLOCKS

    record("alloc(evict)+register+free", ours_evict, base_evict)
    pool.check_integrity()

    return [
        PoolResult(num_blocks, name, float(ours), float(theirs), int(ops))
        for name, (ours, theirs, ops) in results.items()
    ]


# ---------------------------------------------------------------------------- scheduler


@dataclass(frozen=True)
class SchedulerResult:
    scenario: str
    num_requests: int
    num_blocks: int
    prefill_steps: int
    decode_steps: int
    scheduled_tokens: int
    preemptions: int
    seconds: float  # schedule() + postprocess() only
    decode_seconds: float
    decode_tokens: int

    @property
    def us_per_token(self) -> float:
        return self.seconds / self.scheduled_tokens * 1e6

    @property
    def us_per_decode_step(self) -> float:
        return self.decode_seconds / max(self.decode_steps, 1) * 1e6

    @property
    def us_per_decode_token(self) -> float:
        """Decode-step time per sequence in the step: the per-sequence cost of a step."""
        return self.decode_seconds / max(self.decode_tokens, 1) * 1e6


def bench_scheduler(
    scenario: str, num_requests: int, num_blocks: int, shared_prefix: int, seed: int
) -> SchedulerResult:
    rng = random.Random(seed)
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=256,
        max_num_seqs=512,
        max_num_batched_tokens=16384,
        max_model_len=4096,
    )
    scheduler = Scheduler(config)
    prefix = [rng.randrange(10000) for _ in range(shared_prefix)]
    for seq_id in range(num_requests):
        prompt = prefix + [rng.randrange(10000) for _ in range(rng.randint(100, 1024))]
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 1024))
        scheduler.add(DomainSequence(seq_id, prompt, params))
    sampler = random.Random(seed + 1)
    seconds = decode_seconds = 0.0
    scheduled = decode_tokens = 0
    clock = CLOCK
    while True:
        start = clock()
        plan = scheduler.schedule()
        planned = clock()
        if plan is None:
            break
        tokens = [sampler.randrange(10000) for _ in plan.sample_indices]  # the "model"
        resumed = clock()
        scheduler.postprocess(plan, tokens)
        elapsed = (planned - start) + (clock() - resumed)
        seconds += elapsed
        if not plan.is_prefill:
            decode_seconds += elapsed
            decode_tokens += plan.num_tokens
        scheduled += plan.num_tokens
    stats = scheduler.stats()
    if scheduler.has_unfinished() or scheduler.pool.num_free_blocks != num_blocks:
        raise RuntimeError("the simulated run did not drain")
    return SchedulerResult(
        scenario,
        num_requests,
        num_blocks,
        stats.num_prefill_steps,
        stats.num_decode_steps,
        scheduled,
        stats.num_preemptions,
        seconds,
        decode_seconds,
        decode_tokens,
    )


# ------------------------------------------------------------------------------- report


def _fmt_ns(ns: float) -> str:
    return f"{ns / 1000:.2f} µs" if ns >= 1000 else f"{ns:.0f} ns"


def pool_table(results: list[PoolResult]) -> str:
    lines = [
        "| pool blocks | workload | pagedinfer per block op | ops/s | nano-vLLM-style deque "
        "per block op | ops/s | deque / ours | deque ops timed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        lines.append(
            f"| {row.num_blocks:,} | {row.workload} | {_fmt_ns(row.ours_ns)} | "
            f"{1e9 / row.ours_ns / 1e6:.2f} M | {_fmt_ns(row.base_ns)} | "
            f"{1e9 / row.base_ns / 1e6:.3g} M | {row.base_ns / row.ours_ns:.1f}x | "
            f"{row.base_ops:,} |"
        )
    return "\n".join(lines)


def scheduler_table(results: list[SchedulerResult]) -> str:
    lines = [
        "| scenario | requests | pool blocks (x256 tokens) | steps (prefill + decode) | "
        "scheduled tokens | preemptions | schedule+postprocess | µs / scheduled token | "
        "µs / decode step | µs / decode token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        lines.append(
            f"| {row.scenario} | {row.num_requests} | {row.num_blocks:,} | "
            f"{row.prefill_steps} + {row.decode_steps} | {row.scheduled_tokens:,} | "
            f"{row.preemptions} | {row.seconds:.2f} s | {row.us_per_token:.2f} | "
            f"{row.us_per_decode_step:.0f} | {row.us_per_decode_token:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Block pool and scheduler micro-benchmarks.")
    parser.add_argument("--quick", action="store_true", help="small sizes; runs in seconds")
    parser.add_argument("--sizes", help="pool sizes in blocks, comma-separated")
    parser.add_argument("--ops", type=int, help="block ops timed per size and workload")
    parser.add_argument(
        "--baseline-seconds",
        type=float,
        help="time budget per baseline measurement (the deque baseline is O(pool) per hit)",
    )
    parser.add_argument("--requests", type=int, help="requests in the scheduler workload")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000, 1_000_000]
    if args.sizes:
        sizes = [int(size) for size in args.sizes.split(",")]
    ops = args.ops or (2_000 if args.quick else 20_000)
    budget = args.baseline_seconds or (0.25 if args.quick else 3.0)
    requests = args.requests or (16 if args.quick else 256)
    rng = random.Random(args.seed)

    print(
        f"Python {platform.python_version()} on {platform.machine()}, {platform.system()}; "
        f"command: {' '.join(['python', *sys.argv])}\n"
    )
    # Cyclic GC would add pauses proportional to the million objects of a big pool to
    # whichever op happens to trigger it; none of these structures form cycles.
    gc.disable()
    try:
        pool_results: list[PoolResult] = []
        for size in sizes:
            started = time.perf_counter()
            pool_results.extend(bench_pool_size(size, ops, budget, rng))
            gc.collect()
            print(f"  pool size {size:,}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
        print(
            f"Block pool: block_size {BLOCK_SIZE}, chains of {CHAIN_BLOCKS} blocks; per cell up "
            f"to {ops:,} block ops in {ROUNDS} rounds, fastest round shown (the baseline stops "
            f"after {budget:g} s).\n"
        )
        print(pool_table(pool_results))

        # Qwen3-0.6B's bf16 KV cache takes 112 KiB per token, 29.4 MB per 256-token block:
        # 2,048 blocks are ~60 GB (an 80 GB H100 at 0.9 utilization), 160 blocks ~4.7 GB
        # (the 8 GB laptop GPU of nano-vLLM's benchmark).
        gpu_blocks = 2048
        laptop_blocks = 160
        scenarios = [
            ("GPU-sized pool", gpu_blocks, 0),
            ("GPU-sized pool, 512-token shared prefix", gpu_blocks, 512),
            ("laptop-GPU-sized pool", laptop_blocks, 0),
        ]
        # Best of three runs: the run is deterministic, only the machine's noise varies.
        sched_results = [
            min(
                (bench_scheduler(name, requests, blocks, prefix, args.seed) for _ in range(3)),
                key=lambda result: result.seconds,
            )
            for name, blocks, prefix in scenarios
        ]
        print(
            f"\nScheduler: {requests} requests, prompt and output lengths U[100, 1024], "
            "block_size 256, max_num_batched_tokens 16384; sampling not timed; best of 3 runs.\n"
        )
        print(scheduler_table(sched_results))
    finally:
        gc.enable()
    return 0


if __name__ == "__main__":
    sys.exit(main())
