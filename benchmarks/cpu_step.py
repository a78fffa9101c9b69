"""The CPU path's cost per step, side by side with another checkout (a baseline).

Two measurements per run, both in CPU time of the measuring process (``time.process_time``:
on a shared machine wall time varies several-fold with the other load, CPU time much less):

* **per decode step**: a ``ModelRunner`` on the ``small`` random checkpoint decodes 64
  sequences; ``prepare`` (plan to tensors) and ``execute`` (prepare, model, sampling) are timed
  for 50 steps after 10 warm-up steps (medians);
* **generate**: ``Engine.generate`` on the cpu-scale workload of ``throughput.py`` (64
  requests, prompts U[16, 256], outputs U[16, 128], temperature 0.6).

Each run is a fresh process with one torch thread; with ``--baseline DIR`` (another checkout,
e.g. ``git worktree add /tmp/base main``) the two alternate, ``--rounds`` times, and the table
shows medians, the best run and the ratios::

    python benchmarks/cpu_step.py --baseline /tmp/base --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Run from a plain checkout (`python benchmarks/NAME.py` at the repository root, no install):
# this repository's src/ comes first on the import path.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(1, str(REPO / "benchmarks"))  # the sibling _alternating.py, however this runs

from _alternating import alternate, comparison_table


def measure(checkout: Path, cache_dir: Path) -> dict[str, float]:
    """One run in this process, importing pagedinfer from ``checkout/src``."""
    sys.path.insert(0, str(checkout / "src"))
    import torch

    from pagedinfer import Engine, SamplingParams
    from pagedinfer.adapters.model_runner import ModelRunner
    from pagedinfer.adapters.models import random_checkpoint
    from pagedinfer.adapters.runner_config import RunnerConfig
    from pagedinfer.domain import Scheduler, SchedulerConfig, Sequence

    torch.set_num_threads(1)
    model = cache_dir / "small"
    if not (model / "config.json").exists():
        random_checkpoint.build_random_checkpoint(model, "small", seed=0)
    rng = random.Random(0)
    runner = ModelRunner(
        RunnerConfig(
            model_path=str(model),
            device=torch.device("cpu"),
            dtype=torch.float32,
            block_size=256,
            attention_backend="torch",
            max_num_seqs=64,
            max_num_batched_tokens=16384,
            max_model_len=512,
            num_kv_blocks=200,
        )
    )
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=200, block_size=256, max_num_seqs=64, max_model_len=512)
    )
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=200)
    for index in range(64):
        prompt = [rng.randint(0, 4000) for _ in range(rng.randint(16, 200))]
        scheduler.add(Sequence(index, prompt, params))
    prepare: list[float] = []
    execute: list[float] = []
    for step in range(61):
        plan = scheduler.schedule()
        assert plan is not None
        began = time.process_time()
        if step:
            runner.prepare(plan)
        prepared = time.process_time()
        sampled = runner.execute(plan)
        done = time.process_time()
        # A StepOutput (or, in checkouts before it, the list of sampled ids).
        scheduler.postprocess(plan, getattr(sampled, "sampled_token_ids", sampled))
        if step > 10:  # the first step is the prefill; then warm up
            prepare.append(prepared - began)
            execute.append(done - prepared)
    runner.close()

    rng = random.Random(0)
    prompts = [[rng.randint(0, 4000) for _ in range(rng.randint(16, 256))] for _ in range(64)]
    outputs = [rng.randint(16, 128) for _ in range(64)]
    engine = Engine(
        str(model),
        device="cpu",
        kv_block_size=256,
        max_num_batched_tokens=4096,
        max_model_len=512,
    )
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    requests = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in outputs]
    began = time.process_time()
    engine.generate(prompts, requests, use_tqdm=False)
    generate = time.process_time() - began
    engine.close()
    return {
        "prepare_us": statistics.median(prepare) * 1e6,
        "execute_ms": statistics.median(execute) * 1e3,
        "generate_s": generate,
    }


def run(checkout: Path, cache_dir: Path) -> dict[str, float]:
    """One measurement in a fresh process (so neither version warms the other's caches)."""
    result = subprocess.run(
        [sys.executable, __file__, "--worker", str(checkout), "--cache-dir", str(cache_dir)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    values: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return values


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Path(".bench-cache"))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cache_dir = args.cache_dir.resolve()
    if args.worker is not None:
        print(json.dumps(measure(args.worker, cache_dir)))
        return 0
    checkouts = {"this checkout": REPO}
    if args.baseline is not None:
        checkouts = {"baseline": args.baseline.resolve(), **checkouts}
    results = alternate(checkouts, args.rounds, lambda checkout: run(checkout, cache_dir))
    print()
    print(
        "\n".join(
            comparison_table(
                results,
                (
                    ("prepare_us", "prepare, decode step of 64 sequences (µs)"),
                    ("execute_ms", "execute, decode step of 64 sequences (ms)"),
                    ("generate_s", "generate, cpu-scale workload (s)"),
                ),
            )
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
