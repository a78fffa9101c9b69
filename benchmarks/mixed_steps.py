"""Mixed steps vs prefill-first, side by side: decode stalls and inter-token latency.

Long prompts arrive while other requests decode. Under the ``prefill_first`` policy every
decoding sequence waits while a prompt is prefilled (in chunks of the token budget, one step
each); under ``mixed`` (the default) prompt chunks ride along with the decoding sequences'
tokens. Two sections, both policies each:

* **stalls** (no model, the domain ``Scheduler`` with a fake sampler): 16 requests decode
  while 12 prompts of 1,500 tokens arrive, one every 25 steps, with a 256-token budget.
  Counted: *stall steps* (steps in which some running decoding sequence got no token),
  *stalled tokens* (the sum over steps of the decoding sequences left out), the longest wait of
  one sequence (consecutive steps without a token) and preemptions.
* **latency** (``Engine`` on the CPU, a random Qwen3 checkpoint, the torch backend):
  ``--chat`` requests (prompts U[32, 128], outputs U[64, 128]) start together; ``--long``
  prompts of ``--long-len`` tokens (outputs of 16) arrive one by one, each when the first chat
  request has generated another ``--every`` tokens: arrivals follow the decoders' progress, so
  both policies see the same scenario. ``Engine.step()`` drives it; a token's time is the end
  of the step that produced it. Reported: inter-token latency (ITL) p50/p99 over all
  consecutive tokens of every request, time to first token (TTFT) of the long prompts p50/p99,
  output tokens per second of wall time, the process's CPU time, stall steps as above. Each
  policy runs ``--repeats`` times, alternating; the table shows the median run (by ITL p99)
  and the range of ITL p99.

* **attention** (the torch backend, CPU): how a mixed step's attention should run. The same
  mixed plan (``--rows`` decode rows with contexts U``--contexts`` (default U[200, 600]) and one
  fresh 256-token prompt,
  or a 256-token chunk after a 512-token cached prefix) is executed by the model runner again
  and again, with the step split into its decode part (batched decode path) and its prefill
  part, or with the prefill path serving every row (a decode row is a one-token chunk with a
  cached prefix: one gather and SDPA call per row). Median CPU time of ``--iterations`` runs.

Wall-clock numbers on a shared machine are inflated by other processes; the ITL columns are
also given in CPU time of this process (``time.process_time`` at the end of each step), which
other processes disturb less. Compare the policies within one run.

    python benchmarks/mixed_steps.py                  # both sections, ~2 minutes on 2 cores
    python benchmarks/mixed_steps.py --section stalls # the scheduler only, a second
    python benchmarks/mixed_steps.py --quick          # tiny sizes (the smoke test)
    python benchmarks/mixed_steps.py --section attention
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# Run from a plain checkout (`python benchmarks/NAME.py` at the repository root, no install):
# this repository's src/ comes first on the import path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pagedinfer.domain import SamplingParams, Scheduler, SchedulerConfig, Sequence

POLICIES = ("mixed", "prefill_first")


# --------------------------------------------------------------------------------- stalls
@dataclass
class StallCount:
    """Decode stalls of one run: steps in which some running decoder got no token."""

    steps: int = 0
    mixed_steps: int = 0
    stall_steps: int = 0
    stalled_tokens: int = 0
    longest_wait: int = 0
    preemptions: int = 0
    _waiting_since: dict[int, int] = field(default_factory=dict)

    def record(self, decoding: Iterable[int], served: set[int], gone: set[int]) -> None:
        """One step: ``decoding`` ran before it, ``served`` got a token, ``gone`` left
        (finished or preempted) during it."""
        self.steps += 1
        left_out = [seq_id for seq_id in decoding if seq_id not in served and seq_id not in gone]
        if left_out:
            self.stall_steps += 1
            self.stalled_tokens += len(left_out)
        for seq_id in left_out:
            waited = self._waiting_since.get(seq_id, 0) + 1
            self._waiting_since[seq_id] = waited
            self.longest_wait = max(self.longest_wait, waited)
        for seq_id in served:
            self._waiting_since.pop(seq_id, None)


def simulate_stalls(policy: str, *, quick: bool, seed: int) -> StallCount:
    """The stall scenario on the domain scheduler alone (no model, a fake sampler)."""
    rng = random.Random(seed)
    num_decoders, num_long, long_len, every, budget = (
        (4, 3, 300, 10, 64) if quick else (16, 12, 1500, 25, 256)
    )
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=4096,
            block_size=16,
            max_num_seqs=64,
            max_num_batched_tokens=budget,
            max_model_len=4096,
            scheduling_policy=policy,
        )
    )
    long_params = SamplingParams(max_tokens=16, ignore_eos=True)
    for seq_id in range(num_decoders):
        prompt = [rng.randrange(1, 10000) for _ in range(32)]
        scheduler.add(Sequence(seq_id, prompt, SamplingParams(max_tokens=400, ignore_eos=True)))
    count = StallCount()
    arrivals = {20 + every * i: num_decoders + i for i in range(num_long)}
    step = 0
    while scheduler.has_unfinished() or arrivals:
        if step in arrivals:
            prompt = [rng.randrange(1, 10000) for _ in range(long_len)]
            scheduler.add(Sequence(arrivals.pop(step), prompt, long_params))
        step += 1
        decoding = [seq.seq_id for seq in scheduler.running if seq.decoding]
        preemptions = scheduler.stats().num_preemptions
        plan = scheduler.schedule()
        if plan is None:
            continue
        running = {seq.seq_id for seq in scheduler.running}
        gone = {seq_id for seq_id in decoding if seq_id not in running}  # preempted
        updated = scheduler.postprocess(plan, [rng.randrange(10000)] * plan.num_samples)
        served = {seq.seq_id for seq in updated}
        count.record(decoding, served, gone)
        count.mixed_steps += plan.is_mixed
        count.preemptions += scheduler.stats().num_preemptions - preemptions
    return count


def stalls_table(quick: bool, seed: int) -> str:
    lines = [
        "| policy | steps | mixed steps | stall steps | stalled tokens | longest wait (steps) "
        "| preemptions |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for policy in POLICIES:
        c = simulate_stalls(policy, quick=quick, seed=seed)
        lines.append(
            f"| {policy} | {c.steps} | {c.mixed_steps} | {c.stall_steps} | {c.stalled_tokens} "
            f"| {c.longest_wait} | {c.preemptions} |"
        )
    return "\n".join(lines)


# -------------------------------------------------------------------------------- latency
@dataclass
class LatencyRun:
    policy: str
    itl_wall: list[float]
    itl_cpu: list[float]
    ttft_long_wall: list[float]
    output_tokens: int
    wall_seconds: float
    cpu_seconds: float
    stalls: StallCount

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_seconds


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``, in milliseconds."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank] * 1e3


def num_generated(output: object) -> int:
    """Tokens a ``RequestOutput`` has generated so far (the one place that reads its shape)."""
    return len(output.outputs[0].token_ids)  # type: ignore[attr-defined]


def run_latency(model: str, policy: str, args: argparse.Namespace) -> LatencyRun:
    from pagedinfer import Engine

    rng = random.Random(args.seed)
    vocab = min(4000, int(json.loads((Path(model) / "config.json").read_text())["vocab_size"]))
    chat = [
        ([rng.randrange(1, vocab) for _ in range(rng.randint(32, 128))], rng.randint(64, 128))
        for _ in range(args.chat)
    ]
    long = [[rng.randrange(1, vocab) for _ in range(args.long_len)] for _ in range(args.long)]
    engine = Engine(
        model,
        device="cpu",
        dtype="float32",
        kv_block_size=args.kv_block_size,
        max_model_len=max(args.long_len + 64, 512),
        max_num_seqs=64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=policy,
    )
    try:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        gc.collect()
        started_wall, started_cpu = time.perf_counter(), time.process_time()
        added: dict[int, tuple[float, float, bool]] = {}  # id -> (wall, cpu, is_long)
        for prompt, max_tokens in chat:
            params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True)
            added[engine.add_request(prompt, params)] = (started_wall, started_cpu, False)
        first_chat = next(iter(added))
        seen: dict[int, int] = {}  # tokens of each request so far
        last: dict[int, tuple[float, float]] = {}  # time of each request's latest token
        itl_wall: list[float] = []
        itl_cpu: list[float] = []
        ttft_long: list[float] = []
        stalls = StallCount()
        pending = list(long)
        produced = 0
        while engine.has_unfinished_requests() or pending:
            if pending and seen.get(first_chat, 0) >= args.every * (args.long - len(pending) + 1):
                params = SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True)
                added[engine.add_request(pending.pop(0), params)] = (
                    time.perf_counter(),
                    time.process_time(),
                    True,
                )
            decoding = [i for i, n in seen.items() if n > 0 and i in added]
            outputs = engine.step()
            wall, cpu = time.perf_counter(), time.process_time()
            served: set[int] = set()
            gone: set[int] = set()
            for output in outputs:
                rid = output.request_id
                count = num_generated(output)
                new = count - seen.get(rid, 0)
                if new > 0:
                    served.add(rid)
                    if rid in last:
                        itl_wall.append(wall - last[rid][0])
                        itl_cpu.append(cpu - last[rid][1])
                    elif added[rid][2]:
                        ttft_long.append(wall - added[rid][0])
                    last[rid] = (wall, cpu)
                    produced += new
                seen[rid] = count
                if output.finished:
                    gone.add(rid)
                    added.pop(rid)
            stalls.record(decoding, served, gone)
        stats = engine.scheduler.stats()
        stalls.mixed_steps = stats.num_mixed_steps
        stalls.preemptions = stats.num_preemptions
        wall_seconds = time.perf_counter() - started_wall
        cpu_seconds = time.process_time() - started_cpu
    finally:
        engine.close()
    return LatencyRun(
        policy, itl_wall, itl_cpu, ttft_long, produced, wall_seconds, cpu_seconds, stalls
    )


def latency_table(runs: dict[str, list[LatencyRun]]) -> str:
    lines = [
        "| policy | ITL p50 (ms) | ITL p99 (ms) | ITL p99 range (ms) | ITL p50 / p99, CPU time "
        "(ms) | TTFT long p50 / p99 (ms) | output tok/s | CPU s | steps (mixed) "
        "| stall steps | preemptions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for policy, policy_runs in runs.items():
        p99s = [percentile(r.itl_wall, 99) for r in policy_runs]
        run = sorted(policy_runs, key=lambda r: percentile(r.itl_wall, 99))[len(policy_runs) // 2]
        s = run.stalls
        lines.append(
            f"| {policy} | {percentile(run.itl_wall, 50):.1f} | {percentile(run.itl_wall, 99):.1f} "
            f"| {min(p99s):.1f}-{max(p99s):.1f} "
            f"| {percentile(run.itl_cpu, 50):.1f} / {percentile(run.itl_cpu, 99):.1f} "
            f"| {percentile(run.ttft_long_wall, 50):.0f} / "
            f"{percentile(run.ttft_long_wall, 99):.0f} "
            f"| {run.throughput:.1f} | {run.cpu_seconds:.1f} | {s.steps} ({s.mixed_steps}) "
            f"| {s.stall_steps} | {s.preemptions} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ attention
def time_mixed_strategies(
    model: str, num_rows: int, prefix: int, args: argparse.Namespace
) -> dict[bool, float]:
    """Median CPU seconds of ``ModelRunner.execute`` on one mixed plan, split or not."""
    from pagedinfer import Engine

    rng = random.Random(args.seed)
    max_len = max(1024, args.contexts[1] + 64, prefix + 512)
    engine = Engine(
        model,
        device="cpu",
        dtype="float32",
        kv_block_size=args.kv_block_size,
        max_model_len=max_len,
        max_num_seqs=max(num_rows + 2, 8),
        max_num_batched_tokens=4096,
        num_kv_blocks=(num_rows + 2) * max_len // args.kv_block_size,  # nothing is preempted
        scheduling_policy="mixed",
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        vocab = min(4000, engine.model_config.vocab_size)
        for _ in range(num_rows):
            engine.add_request(
                [rng.randrange(1, vocab) for _ in range(rng.randint(*args.contexts))], params
            )
        scheduler = engine.scheduler
        while scheduler.waiting or any(not seq.decoding for seq in scheduler.running):
            engine.step()
        long = [rng.randrange(1, vocab) for _ in range(prefix + 256)]
        if prefix:  # its first `prefix` tokens: computed (and cached) by an earlier request
            engine.generate([[*long[:prefix], 1]], SamplingParams(max_tokens=1), use_tqdm=False)
        engine.add_request(long, params)
        plan = scheduler.schedule()  # run again and again, never recorded
        assert plan is not None and plan.is_mixed and plan.num_decode_rows == num_rows
        runner = engine._executor
        backend = runner.backend  # type: ignore[union-attr]
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.iterations + 1):  # the first round warms up
            for split in (True, False):
                backend.split_mixed_steps = split
                gc.collect()
                started = time.process_time()
                runner.execute(plan)  # type: ignore[union-attr]
                times[split].append(time.process_time() - started)
        return {split: statistics.median(values[1:]) for split, values in times.items()}
    finally:
        engine.close()


def attention_table(model: str, args: argparse.Namespace) -> str:
    lines = [
        "| decode rows | prefill chunk | split: decode + prefill path (ms) "
        "| prefill path for every row (ms) | split speed-up |",
        "|---:|---|---:|---:|---:|",
    ]
    for num_rows in args.rows:
        for prefix in (0, 512):
            t = time_mixed_strategies(model, num_rows, prefix, args)
            chunk = "256 fresh tokens" if not prefix else f"256 tokens after {prefix} cached"
            lines.append(
                f"| {num_rows} | {chunk} | {t[True] * 1e3:.1f} | {t[False] * 1e3:.1f} "
                f"| {t[False] / t[True]:.2f}x |"
            )
    return "\n".join(lines)


def build_model(args: argparse.Namespace) -> str:
    from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

    target = Path(args.cache_dir) / f"random-{args.random_weights}"
    if not (target / "config.json").exists():
        build_random_checkpoint(target, args.random_weights, seed=0)
    return str(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--section", choices=("all", "stalls", "latency", "attention"), default="all"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes; a smoke test")
    parser.add_argument("--model", help="checkpoint directory (default: a random one)")
    parser.add_argument("--random-weights", default=None, help="preset (default: small)")
    parser.add_argument("--cache-dir", default=".bench-cache")
    parser.add_argument("--chat", type=int, help="requests decoding from the start (24)")
    parser.add_argument("--long", type=int, help="long prompts arriving meanwhile (6)")
    parser.add_argument("--long-len", type=int, help="tokens of a long prompt (1536)")
    parser.add_argument("--every", type=int, help="chat tokens between arrivals (12)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="(512)")
    parser.add_argument("--kv-block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, help="runs per policy (3)")
    parser.add_argument(
        "--rows", type=int, nargs="+", help="attention: decode rows per mixed step (16 64)"
    )
    parser.add_argument("--iterations", type=int, help="attention: timed runs per strategy (10)")
    parser.add_argument(
        "--contexts",
        type=int,
        nargs=2,
        default=(200, 600),
        metavar=("MIN", "MAX"),
        help="attention: prompt lengths of the decoding sequences",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    defaults = (
        {"chat": 3, "long": 2, "long_len": 48, "every": 2, "max_num_batched_tokens": 32}
        if args.quick
        else {"chat": 24, "long": 6, "long_len": 1536, "every": 12, "max_num_batched_tokens": 512}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.random_weights = args.random_weights or ("tiny" if args.quick else "small")
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.rows = args.rows or ([2] if args.quick else [16, 64])
    args.iterations = args.iterations or (1 if args.quick else 10)
    print(
        f"Python {platform.python_version()} on {platform.machine()}, {platform.system()}\n"
        f"command: {' '.join(['python', *sys.argv])}\n"
    )
    if args.section in ("all", "stalls"):
        print("## Decode stalls (scheduler only, fake sampler)\n")
        print(stalls_table(args.quick, args.seed))
        print()
    model = ""
    if args.section != "stalls":
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        model = args.model or build_model(args)
    if args.section in ("all", "attention"):
        print(
            f"## Mixed-step attention on the CPU: split or not (torch backend, "
            f"{torch.get_num_threads()} threads, model {model}, kv_block_size "
            f"{args.kv_block_size}; CPU ms per ModelRunner.execute, median of "
            f"{args.iterations})\n"
        )
        print(attention_table(model, args))
        print()
    if args.section in ("all", "latency"):
        print(
            f"## Inter-token latency (Engine on CPU, {torch.get_num_threads()} threads, "
            f"model {model})\n\n{args.chat} chat requests decoding; {args.long} prompts of "
            f"{args.long_len} tokens arriving every {args.every} chat tokens; "
            f"max_num_batched_tokens {args.max_num_batched_tokens}, kv_block_size "
            f"{args.kv_block_size}; {args.repeats} run(s) per policy, alternating.\n"
        )
        runs: dict[str, list[LatencyRun]] = {policy: [] for policy in POLICIES}
        for _ in range(args.repeats):
            for policy in POLICIES:
                runs[policy].append(run_latency(model, policy, args))
        tokens = {run.output_tokens for policy_runs in runs.values() for run in policy_runs}
        if len(tokens) != 1:
            raise RuntimeError(f"the runs produced different token counts: {sorted(tokens)}")
        print(latency_table(runs))
        mixed = statistics.median(percentile(r.itl_wall, 99) for r in runs["mixed"])
        first = statistics.median(percentile(r.itl_wall, 99) for r in runs["prefill_first"])
        print(f"\nITL p99 (median of runs): prefill_first / mixed = {first / mixed:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
