"""Async scheduling on the CPU: the sync step loop against one step in flight, side by side.

One process, two engines on the same random checkpoint (``small`` by default), identical
but for ``async_scheduling``; every workload runs on each in turn, ``--rounds`` times
(so drifts of a shared machine hit both alike), and the table gives the median output
tokens per second of wall time (the best run in brackets) and the ratio async / sync.
Workloads (greedy, ``ignore_eos``):

* ``batch-1``: one request, a 32-token prompt, 128 output tokens (decode latency);
* ``batch-16``: 16 requests, prompts U[16, 128], 64 output tokens each;
* ``batch-64``: ``throughput.py``'s cpu workload, 64 requests, prompts U[16, 256], outputs
  U[16, 128].

Torch runs ``--threads`` intra-op threads (1 by default, as ``num_threads="auto"`` on two
cores): the async engine's worker thread runs the forward on one core while the host
thread plans and records on the other.

    python benchmarks/async_scheduling.py --rounds 5
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

# Run from a plain checkout: this repository's src/ comes first on the import path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

Workload = tuple[list[list[int]], list[SamplingParams]]


def workloads(vocab: int) -> dict[str, Workload]:
    rng = random.Random(0)

    def greedy(tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    def prompt(low: int, high: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(low, high))]

    return {
        "batch-1": ([prompt(32, 32)], [greedy(128)]),
        "batch-16": ([prompt(16, 128) for _ in range(16)], [greedy(64)] * 16),
        "batch-64": (
            [prompt(16, 256) for _ in range(64)],
            [greedy(rng.randint(16, 128)) for _ in range(64)],
        ),
    }


def run(engine: Engine, workload: Workload) -> tuple[float, float]:
    """Output tokens per second of wall time, and CPU seconds of this process."""
    prompts, params = workload
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return tokens / wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="a checkpoint directory (default: a random one)")
    parser.add_argument("--random-weights", default="small")
    parser.add_argument("--cache-dir", default=".bench-cache")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="*", help="workload names to run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        directory = Path(args.cache_dir) / args.random_weights
        if not (directory / "config.json").exists():
            build_random_checkpoint(directory, args.random_weights, seed=0)
        model = str(directory)
    options = {"device": "cpu", "kv_block_size": 256, "max_model_len": 512, "num_kv_blocks": 200}
    engines = {flag: Engine(model, async_scheduling=flag, **options) for flag in (False, True)}
    vocab = engines[False].model_config.vocab_size
    chosen = {
        name: load
        for name, load in workloads(min(vocab, 4000)).items()
        if not args.only or name in args.only
    }
    results: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for engine in engines.values():  # warm-up
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    for round_index in range(args.rounds):
        for name, load in chosen.items():
            for flag, engine in engines.items():
                results.setdefault((name, flag), []).append(run(engine, load))
        print(f"round {round_index + 1} done", file=sys.stderr, flush=True)
    print(
        f"{platform.processor() or platform.machine()} CPU, torch {torch.__version__}, "
        f"{args.threads} torch thread(s), {args.rounds} rounds, model {model}\n"
    )
    print("| workload | sync tok/s | async tok/s | async / sync | CPU s sync | CPU s async |")
    print("|---|---|---|---|---|---|")
    for name in chosen:
        cells = []
        medians = []
        cpus = []
        for flag in (False, True):
            runs = results[(name, flag)]
            median = statistics.median(r[0] for r in runs)
            medians.append(median)
            cpus.append(statistics.median(r[1] for r in runs))
            cells.append(f"{median:.0f} ({max(r[0] for r in runs):.0f})")
        print(
            f"| {name} | {cells[0]} | {cells[1]} | {medians[1] / medians[0]:.2f} | "
            f"{cpus[0]:.2f} | {cpus[1]:.2f} |"
        )
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
