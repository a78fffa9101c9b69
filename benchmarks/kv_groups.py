"""KV groups (hybrid attention) in the domain: blocks held per sequence, and the host cost.

Two measurements, no model (the scheduler with a fake sampler):

1. **Memory.** One request of a Gemma-3-shaped model (``--layers`` layers, five sliding
   layers of window ``--window`` to one full layer: ``group_layers``) decodes from a short
   prompt to ``--max-len`` tokens. At each context length in the table: the blocks each group
   holds, and the KV held in *layer-pages* (blocks x layers per group, the last group's
   unused slots included: what the cache holds), against the same model with the window
   ignored (every layer full attention, one group). The sliding groups stay flat past the
   window; the full group grows.
2. **Host cost.** nano-vLLM's workload (``--requests`` requests, prompts and outputs uniform
   in [100, 1024]) scheduled with one full group, two groups (GPT-OSS-shaped: sliding and
   full layers alternating) and the Gemma-3-shaped groups: CPU µs per scheduled token
   (schedule + plan + postprocess), fastest of ``--repeats`` runs each, alternating.
   ``--profile N`` prints cProfile's top entries for the run with ``N`` groups instead.

    python benchmarks/kv_groups.py                  # ~1 minute
    python benchmarks/kv_groups.py --quick          # a smoke test
    python benchmarks/kv_groups.py --host-only --repeats 5
    python benchmarks/kv_groups.py --profile 7
"""

from __future__ import annotations

import argparse
import cProfile
import platform
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pagedinfer.domain import SamplingParams, Scheduler, SchedulerConfig, Sequence
from pagedinfer.domain.kv_groups import KVGroupLayout, KVGroupSpec, group_layers


def gemma3_groups(num_layers: int, window: int) -> tuple[KVGroupSpec, ...]:
    return group_layers([None if (layer + 1) % 6 == 0 else window for layer in range(num_layers)])


def gpt_oss_groups(num_layers: int, window: int) -> tuple[KVGroupSpec, ...]:
    return group_layers([window if layer % 2 == 0 else None for layer in range(num_layers)])


def held(scheduler: Scheduler, seq: Sequence) -> list[int]:
    """Blocks ``seq`` holds in each group (null entries are not blocks)."""
    null = getattr(scheduler._allocator, "null_block", None)
    return [
        sum(1 for block in table if block != null)
        for table in (seq.block_table, *seq.group_block_tables)
    ]


def memory(args: argparse.Namespace) -> None:
    groups = gemma3_groups(args.layers, args.window)
    layout = KVGroupLayout.of(groups)
    size = args.block_size
    config = SchedulerConfig(
        num_blocks=4 * (args.max_len // size + 1) * len(groups),
        block_size=size,
        max_model_len=args.max_len + 1,
        max_num_batched_tokens=2048,
        kv_groups=groups,
    )
    scheduler = Scheduler(config)
    seq = Sequence(0, list(range(1, 101)), SamplingParams(max_tokens=args.max_len, ignore_eos=True))
    scheduler.add(seq)
    marks = [m for m in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768) if m <= args.max_len]
    rows = []
    while scheduler.has_unfinished() and marks:
        plan = scheduler.schedule()
        assert plan is not None
        scheduler.postprocess(plan, [7] * plan.num_samples)
        if seq.num_tokens >= marks[0]:
            marks.pop(0)
            per_group = held(scheduler, seq)
            # Every block has a page per slot of a group (a smaller last group's are unused).
            pages = sum(per_group) * layout.layers_per_group
            # Window ignored: every layer full, one group of all layers.
            full_pages = -(-seq.num_tokens // size) * args.layers
            rows.append((seq.num_tokens, per_group, pages, full_pages))
    kinds = ", ".join(
        f"{'full' if g.window is None else f'window {g.window}'} x{len(g.layers)}" for g in groups
    )
    print(
        f"\n### Blocks held by one sequence: {args.layers} layers in {len(groups)} groups "
        f"({kinds}), block_size {size}, {layout.layers_per_group} layers per group\n"
    )
    print("| context | blocks per group (group 0 first) | layer-pages | window ignored | ratio |")
    print("|---:|---|---:|---:|---:|")
    for tokens, per_group, pages, full_pages in rows:
        print(f"| {tokens} | {per_group} | {pages} | {full_pages} | {full_pages / pages:.2f}x |")


def workload(num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))],
            rng.randint(100, 1024),
        )
        for _ in range(num_requests)
    ]


def host_cost(
    groups: tuple[KVGroupSpec, ...], requests: list[tuple[list[int], int]], sampled: list[int]
) -> float:
    """CPU µs per scheduled token; the fake sampler's ids come from ``sampled`` (drawn
    before the clock starts: only the scheduler is timed)."""
    config = SchedulerConfig(
        num_blocks=2048 * max(len(groups), 1) + 1,
        block_size=256,
        max_num_seqs=512,
        max_num_batched_tokens=16384,
        max_model_len=4096,
        kv_groups=groups,
    )
    scheduler = Scheduler(config)
    for index, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.6)
        scheduler.add(Sequence(index, prompt, params))
    tokens = samples = 0
    start = time.process_time()
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        assert plan is not None
        tokens += plan.num_tokens
        first = samples % (len(sampled) - plan.num_samples)
        samples += plan.num_samples
        scheduler.postprocess(plan, sampled[first : first + plan.num_samples])
    return (time.process_time() - start) / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--host-only", action="store_true", help="skip the memory table")
    parser.add_argument("--profile", type=int, choices=(1, 2, 7), help="cProfile one run")
    args = parser.parse_args()
    if args.quick:
        args.max_len, args.requests, args.repeats = 1024, 8, 1
    print(f"Python {platform.python_version()} on {platform.machine()}, {platform.system()}")
    print("command: python benchmarks/kv_groups.py " + " ".join(sys.argv[1:]))
    requests = workload(args.requests, 0)
    rng = random.Random(0)
    sampled = [rng.randrange(10000) for _ in range(1 << 16)]
    configs = {
        "one full group": (),
        "2 groups (GPT-OSS-shaped)": gpt_oss_groups(24, args.window),
        f"{len(gemma3_groups(args.layers, args.window))} groups (Gemma-3-shaped)": gemma3_groups(
            args.layers, args.window
        ),
    }
    if args.profile is not None:
        groups = next(g for g in configs.values() if max(len(g), 1) == args.profile)
        profiler = cProfile.Profile()
        profiler.runcall(host_cost, groups, requests, sampled)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return
    if not args.host_only:
        memory(args)
    best = dict.fromkeys(configs, float("inf"))
    for _ in range(args.repeats):
        for name, groups in configs.items():
            best[name] = min(best[name], host_cost(groups, requests, sampled))
    print(
        f"\n### Host cost, {args.requests} requests of nano-vLLM's workload, block_size 256 "
        f"(window {args.window}, fastest of {args.repeats})\n"
    )
    print("| KV groups | µs / scheduled token |")
    print("|---|---:|")
    for name, value in best.items():
        print(f"| {name} | {value:.3f} |")


if __name__ == "__main__":
    main()
