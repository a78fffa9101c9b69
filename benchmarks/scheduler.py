"""Host cost of one engine step without a model: pagedinfer against nano-vLLM, side by side.

The workload is nano-vLLM's benchmark: 256 requests, prompt and output lengths uniform in
[100, 1024], random token ids in [0, 10000], ``temperature=0.6``, ``ignore_eos``; block size
256, ``max_num_seqs=512``, ``max_num_batched_tokens=16384``, ``max_model_len=4096``, and a
KV pool large enough that nothing is preempted (2,048 blocks: Qwen3-0.6B's bf16 cache in
~60 GB). A fake sampler draws random token ids; no model runs. Timed per step:

* **pagedinfer**: ``Scheduler.schedule()`` (the ``BatchPlan`` included: everything the
  executor copies to the device) and ``Scheduler.postprocess()``, under both scheduling
  policies: ``mixed`` (the default: decode rows and prefill chunks share each step) and
  ``prefill_first`` (nano-vLLM's: a step is all prefill or all decode);
* **nano-vLLM**: a faithful re-implementation, in this file, of its host path: ``Scheduler``
  + ``BlockManager`` (``schedule``, ``postprocess``) and the host-side input building of
  ``ModelRunner.run``: ``prepare_prefill`` / ``prepare_decode`` (with
  ``prepare_block_tables``) and ``prepare_sample``, stopping where nano-vLLM calls
  ``torch.tensor(...)``: its lists are built, not converted (so the baseline is spared the
  list-to-tensor conversions our flat arrays make unnecessary).

Reported per system: µs per scheduled token (all steps), µs per decode step (mean over all
pure decode steps) and µs per decode step with 256 sequences running (the decode steps whose
batch holds all 256 requests, before the first one finishes). Steps are counted as prefill
(chunks only), mixed (decode rows and chunks) and decode (rows only). Times are CPU time of this
process (``time.process_time``): time other processes take on a shared machine is not
counted (their effect on the CPU caches still is). Each system runs ``--repeats`` times,
alternating; the fastest run counts.

    python benchmarks/scheduler.py               # the full workload, ~1 minute
    python benchmarks/scheduler.py --quick       # tiny sizes, a second (the smoke test)
    python benchmarks/scheduler.py --profile     # cProfile of one pagedinfer run, top entries
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable
from copy import copy
from dataclasses import dataclass, field
from enum import Enum, auto
from pathlib import Path

import xxhash

# Run from a plain checkout (`python benchmarks/NAME.py` at the repository root, no install):
# this repository's src/ comes first on the import path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import pagedinfer
from pagedinfer.domain import SamplingParams, Scheduler, SchedulerConfig
from pagedinfer.domain import Sequence as DomainSequence

CLOCK = time.process_time
VOCAB = 10000


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    block_size: int
    num_blocks: int
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    temperature: float = 0.6

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


def make_workload(
    *,
    num_requests: int,
    min_len: int,
    max_len: int,
    block_size: int,
    num_blocks: int,
    seed: int,
) -> Workload:
    """nano-vLLM's bench.py: prompts and outputs U[min_len, max_len], token ids U[0, 10000]."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, VOCAB) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_requests)
    ]
    max_tokens = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    return Workload(prompts, max_tokens, block_size, num_blocks)


@dataclass
class Run:
    """Per-step timings of one run: (is_prefill, sequences in the step, tokens, seconds);
    ``is_prefill`` is True for every step that is not a pure decode step (mixed included)."""

    system: str
    steps: list[tuple[bool, int, int, float]] = field(default_factory=list)
    generated: int = 0
    mixed_steps: int = 0

    @property
    def seconds(self) -> float:
        return sum(step[3] for step in self.steps)

    @property
    def scheduled_tokens(self) -> int:
        return sum(step[2] for step in self.steps)

    def decode_steps(self, num_seqs: int | None = None) -> list[float]:
        return [
            seconds
            for is_prefill, seqs, _, seconds in self.steps
            if not is_prefill and (num_seqs is None or seqs == num_seqs)
        ]

    @property
    def us_per_token(self) -> float:
        return self.seconds / self.scheduled_tokens * 1e6

    def us_per_decode_step(self, num_seqs: int | None = None) -> float:
        steps = self.decode_steps(num_seqs)
        return sum(steps) / len(steps) * 1e6 if steps else float("nan")


# --------------------------------------------------------------------------- pagedinfer


def run_pagedinfer(workload: Workload, sample_seed: int, policy: str = "mixed") -> Run:
    config = SchedulerConfig(
        num_blocks=workload.num_blocks,
        block_size=workload.block_size,
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        max_model_len=workload.max_model_len,
        scheduling_policy=policy,
    )
    scheduler = Scheduler(config)
    for seq_id, (prompt, max_tokens) in enumerate(
        zip(workload.prompts, workload.max_tokens, strict=True)
    ):
        params = SamplingParams(
            temperature=workload.temperature, ignore_eos=True, max_tokens=max_tokens
        )
        scheduler.add(DomainSequence(seq_id, prompt, params))
    rng = random.Random(sample_seed)
    run = Run("pagedinfer" if policy == "mixed" else f"pagedinfer ({policy})")
    clock = CLOCK
    while True:
        start = clock()
        plan = scheduler.schedule()
        planned = clock()
        if plan is None:
            break
        sampled = [rng.randrange(VOCAB) for _ in range(plan.num_samples)]  # the "model"
        resumed = clock()
        scheduler.postprocess(plan, sampled)
        done = clock()
        run.steps.append(
            (plan.is_prefill, plan.num_seqs, plan.num_tokens, (planned - start) + (done - resumed))
        )
        run.generated += len(sampled)
    if scheduler.has_unfinished() or scheduler.pool.num_free_blocks != workload.num_blocks:
        raise RuntimeError("pagedinfer: the run did not drain")
    run.mixed_steps = scheduler.stats().num_mixed_steps
    return run


# ---------------------------------------------------------------------------- nano-vLLM
# A faithful re-implementation of nano-vLLM's host path (nanovllm/engine/{sequence,
# block_manager,scheduler}.py and the list-building half of model_runner.py), kept close to
# the original line by line. One deviation: compute_hash packs the token ids with
# array("q") instead of np.array (the same bytes, and faster), which if anything flatters
# the baseline.


class NanoStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class NanoSequence:
    block_size = 256

    def __init__(
        self, seq_id: int, token_ids: list[int], temperature: float, max_tokens: int
    ) -> None:
        self.seq_id = seq_id
        self.status = NanoStatus.WAITING
        self.token_ids = copy(token_ids)
        self.last_token = token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.ignore_eos = True

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key: slice) -> list[int]:
        return self.token_ids[key]

    @property
    def is_finished(self) -> bool:
        return self.status == NanoStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_cached_blocks(self) -> int:
        return self.num_cached_tokens // self.block_size

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


class NanoBlock:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, hash: int, token_ids: list[int]) -> None:
        self.hash = hash
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class NanoBlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [NanoBlock(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @classmethod
    def compute_hash(cls, token_ids: list[int], prefix: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(array("q", token_ids).tobytes())
        return h.intdigest()

    def _allocate_block(self, block_id: int) -> NanoBlock:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.reset()
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return self.blocks[block_id]

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: NanoSequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq: NanoSequence) -> None:
        assert not seq.block_table
        h = -1
        cache_miss = False
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h) if len(token_ids) == self.block_size else -1
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                cache_miss = True
            if cache_miss:
                block_id = self.free_block_ids[0]
                block = self._allocate_block(block_id)
            else:
                seq.num_cached_tokens += self.block_size
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if h != -1:
                block.update(h, token_ids)
                self.hash_to_block_id[h] = block_id
            seq.block_table.append(block_id)

    def deallocate(self, seq: NanoSequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: NanoSequence) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: NanoSequence) -> None:
        block_table = seq.block_table
        last_block = self.blocks[block_table[-1]]
        if len(seq) % self.block_size == 1:
            assert last_block.hash != -1
            block_id = self.free_block_ids[0]
            self._allocate_block(block_id)
            block_table.append(block_id)
        elif len(seq) % self.block_size == 0:
            assert last_block.hash == -1
            token_ids = seq.block(seq.num_blocks - 1)
            prefix = self.blocks[block_table[-2]].hash if len(block_table) > 1 else -1
            h = self.compute_hash(token_ids, prefix)
            last_block.update(h, token_ids)
            self.hash_to_block_id[h] = last_block.block_id
        else:
            assert last_block.hash == -1


class NanoScheduler:
    def __init__(self, workload: Workload, eos: int = -1) -> None:
        self.max_num_seqs = workload.max_num_seqs
        self.max_num_batched_tokens = workload.max_num_batched_tokens
        self.eos = eos
        self.block_manager = NanoBlockManager(workload.num_blocks, workload.block_size)
        self.waiting: deque[NanoSequence] = deque()
        self.running: deque[NanoSequence] = deque()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: NanoSequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[NanoSequence], bool]:
        # prefill
        scheduled_seqs = []
        num_seqs = 0
        num_batched_tokens = 0
        while self.waiting and num_seqs < self.max_num_seqs:
            seq = self.waiting[0]
            if num_batched_tokens + len(
                seq
            ) > self.max_num_batched_tokens or not self.block_manager.can_allocate(seq):
                break
            num_seqs += 1
            self.block_manager.allocate(seq)
            num_batched_tokens += len(seq) - seq.num_cached_tokens
            seq.status = NanoStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled_seqs.append(seq)
        if scheduled_seqs:
            return scheduled_seqs, True

        # decode
        while self.running and num_seqs < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                num_seqs += 1
                self.block_manager.may_append(seq)
                scheduled_seqs.append(seq)
        assert scheduled_seqs
        self.running.extendleft(reversed(scheduled_seqs))
        return scheduled_seqs, False

    def preempt(self, seq: NanoSequence) -> None:
        seq.status = NanoStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[NanoSequence], token_ids: list[int]) -> None:
        for seq, token_id in zip(seqs, token_ids, strict=False):
            seq.append_token(token_id)
            if (
                not seq.ignore_eos and token_id == self.eos
            ) or seq.num_completion_tokens == seq.max_tokens:
                seq.status = NanoStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)


class NanoRunnerHost:
    """``ModelRunner``'s host-side input building, up to the ``torch.tensor`` calls."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare_block_tables(self, seqs: list[NanoSequence]) -> list[list[int]]:
        max_len = max(len(seq.block_table) for seq in seqs)
        block_tables = [seq.block_table + [-1] * (max_len - len(seq.block_table)) for seq in seqs]
        return block_tables

    def prepare_prefill(self, seqs: list[NanoSequence]) -> tuple[object, ...]:
        input_ids: list[int] = []
        positions: list[int] = []
        cu_seqlens_q = [0]
        cu_seqlens_k = [0]
        max_seqlen_q = 0
        max_seqlen_k = 0
        slot_mapping: list[int] = []
        block_tables = None
        for seq in seqs:
            seqlen = len(seq)
            input_ids.extend(seq[seq.num_cached_tokens :])
            positions.extend(list(range(seq.num_cached_tokens, seqlen)))
            seqlen_q = seqlen - seq.num_cached_tokens
            seqlen_k = seqlen
            cu_seqlens_q.append(cu_seqlens_q[-1] + seqlen_q)
            cu_seqlens_k.append(cu_seqlens_k[-1] + seqlen_k)
            max_seqlen_q = max(seqlen_q, max_seqlen_q)
            max_seqlen_k = max(seqlen_k, max_seqlen_k)
            if not seq.block_table:  # warmup
                continue
            for i in range(seq.num_cached_blocks, seq.num_blocks):
                start = seq.block_table[i] * self.block_size
                if i != seq.num_blocks - 1:
                    end = start + self.block_size
                else:
                    end = start + seq.last_block_num_tokens
                slot_mapping.extend(list(range(start, end)))
        if cu_seqlens_k[-1] > cu_seqlens_q[-1]:  # prefix cache
            block_tables = self.prepare_block_tables(seqs)
        return (
            input_ids,
            positions,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            slot_mapping,
            block_tables,
        )

    def prepare_decode(self, seqs: list[NanoSequence]) -> tuple[object, ...]:
        input_ids = []
        positions = []
        slot_mapping = []
        context_lens = []
        for seq in seqs:
            input_ids.append(seq.last_token)
            positions.append(len(seq) - 1)
            context_lens.append(len(seq))
            slot_mapping.append(
                seq.block_table[-1] * self.block_size + seq.last_block_num_tokens - 1
            )
        block_tables = self.prepare_block_tables(seqs)
        return input_ids, positions, slot_mapping, context_lens, block_tables

    def prepare_sample(self, seqs: list[NanoSequence]) -> list[float]:
        temperatures = []
        for seq in seqs:
            temperatures.append(seq.temperature)
        return temperatures


def run_nano(workload: Workload, sample_seed: int) -> Run:
    NanoSequence.block_size = workload.block_size
    scheduler = NanoScheduler(workload)
    host = NanoRunnerHost(workload.block_size)
    for seq_id, (prompt, max_tokens) in enumerate(
        zip(workload.prompts, workload.max_tokens, strict=True)
    ):
        scheduler.add(NanoSequence(seq_id, prompt, workload.temperature, max_tokens))
    rng = random.Random(sample_seed)
    run = Run("nano-vLLM")
    clock = CLOCK
    while not scheduler.is_finished():
        start = clock()
        seqs, is_prefill = scheduler.schedule()
        if is_prefill:
            host.prepare_prefill(seqs)
            num_tokens = sum(len(seq) - seq.num_cached_tokens for seq in seqs)
        else:
            host.prepare_decode(seqs)
            num_tokens = len(seqs)
        host.prepare_sample(seqs)
        planned = clock()
        sampled = [rng.randrange(VOCAB) for _ in range(len(seqs))]  # the "model"
        resumed = clock()
        scheduler.postprocess(seqs, sampled)
        done = clock()
        # num_tokens is bookkeeping for this report; it is computed inside the timed span
        # only because it must be read before postprocess changes the sequences.
        run.steps.append((is_prefill, len(seqs), num_tokens, (planned - start) + (done - resumed)))
        run.generated += len(sampled)
    if len(scheduler.block_manager.free_block_ids) != workload.num_blocks:
        raise RuntimeError("nano-vLLM: the run did not drain")
    return run


# ------------------------------------------------------------------------------- report

SYSTEMS: dict[str, Callable[[Workload, int], Run]] = {
    "pagedinfer": run_pagedinfer,
    "pagedinfer (prefill_first)": lambda w, seed: run_pagedinfer(w, seed, "prefill_first"),
    "nano-vLLM": run_nano,
}


def best_runs(workload: Workload, repeats: int, seed: int) -> dict[str, Run]:
    """Each system ``repeats`` times, alternating; the fastest run of each counts."""
    best: dict[str, Run] = {}
    for _ in range(repeats):
        for name, runner in SYSTEMS.items():
            gc.collect()
            run = runner(workload, seed + 1)
            if name not in best or run.seconds < best[name].seconds:
                best[name] = run
    expected = sum(workload.max_tokens)
    for run in best.values():
        if run.generated != expected:
            raise RuntimeError(f"{run.system} generated {run.generated} tokens, not {expected}")
    return best


def report(best: dict[str, Run], workload: Workload, repeats: int) -> str:
    full = workload.num_requests
    lines = [
        "| system | steps (prefill + mixed + decode) | scheduled tokens | host time | "
        "µs / scheduled token | µs / decode step (mean) | "
        f"µs / decode step ({full} running) | decode steps with {full} running |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in best.values():
        prefill = sum(1 for step in run.steps if step[0]) - run.mixed_steps
        lines.append(
            f"| {run.system} | {prefill} + {run.mixed_steps} + "
            f"{len(run.steps) - prefill - run.mixed_steps} | "
            f"{run.scheduled_tokens:,} | {run.seconds:.3f} s | {run.us_per_token:.3f} | "
            f"{run.us_per_decode_step():.1f} | {run.us_per_decode_step(full):.1f} | "
            f"{len(run.decode_steps(full))} |"
        )
    theirs = best["nano-vLLM"]
    lines.append("")
    for name in ("pagedinfer", "pagedinfer (prefill_first)"):
        ours = best[name]
        lines.append(
            f"nano-vLLM / {name}: "
            f"{theirs.us_per_token / ours.us_per_token:.2f}x per scheduled token, "
            f"{theirs.us_per_decode_step() / ours.us_per_decode_step():.2f}x per decode step "
            f"(mean), {theirs.us_per_decode_step(full) / ours.us_per_decode_step(full):.2f}x "
            f"per decode step with {full} running (fastest of {repeats} runs each)."
        )
    return "\n".join(lines)


def profile(workload: Workload, seed: int, top: int, policy: str) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile(CLOCK)
    profiler.enable()
    run_pagedinfer(workload, seed + 1, policy)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes; a smoke test")
    parser.add_argument("--requests", type=int, help="requests (default 256; --quick: 16)")
    parser.add_argument("--repeats", type=int, help="runs per system (default 5; --quick: 1)")
    parser.add_argument("--num-blocks", type=int, help="KV pool blocks (default 2048)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="cProfile one pagedinfer run")
    parser.add_argument("--top", type=int, default=25, help="profile entries to print")
    parser.add_argument(
        "--policy", default="mixed", help="scheduling policy to profile (mixed, prefill_first)"
    )
    args = parser.parse_args(argv)

    if args.quick:
        workload = make_workload(
            num_requests=args.requests or 16,
            min_len=10,
            max_len=64,
            block_size=16,
            num_blocks=args.num_blocks or 256,
            seed=args.seed,
        )
    else:
        workload = make_workload(
            num_requests=args.requests or 256,
            min_len=100,
            max_len=1024,
            block_size=256,
            num_blocks=args.num_blocks or 2048,
            seed=args.seed,
        )
    repeats = args.repeats or (1 if args.quick else 5)
    print(
        f"Python {platform.python_version()} on {platform.machine()}, {platform.system()}; "
        f"pagedinfer from {Path(pagedinfer.__file__).parent}\n"
        f"command: {' '.join(['python', *sys.argv])}\n"
    )
    if args.profile:
        profile(workload, args.seed, args.top, args.policy)
        return 0
    best = best_runs(workload, repeats, args.seed)
    print(
        f"{workload.num_requests} requests, block_size {workload.block_size}, "
        f"{workload.num_blocks} KV blocks, max_num_seqs {workload.max_num_seqs}, "
        f"max_num_batched_tokens {workload.max_num_batched_tokens}; fake sampler, no model; "
        "CPU time (time.process_time) of schedule + plan + postprocess.\n"
    )
    print(report(best, workload, repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
