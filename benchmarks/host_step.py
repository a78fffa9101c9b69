"""Host time of a CUDA-graph decode step outside the model, side by side with a baseline.

The GPU's step profile (``benchmarks/step_profile.py``) times the host phases of a step on
nano-vLLM's workload; two of them are pure Python on the host and can be measured on any
machine: **pack inputs** (``ModelRunner.prepare``: the sampling table's deltas, the graph
bucket, the plan packed into the graph's static inputs) and **bookkeeping**
(``Engine._record``: the scheduler's postprocess, stop checks, news for each request's sink).

This script runs the workload (256 requests, prompts and outputs U[100, 1024], random token
ids, ``temperature=0.6``, ``ignore_eos``; block size 256, 2,048 KV blocks, ``max_num_seqs=512``,
``max_model_len=4096``) through a real ``Engine`` on the CPU whose runner packs every step as
on CUDA: graph decode steps go into static inputs (``StepPacker(zero_copy=False)`` with a
``CudaGraphDecodeRunner`` whose graphs do nothing), other steps into the packed buffer. No
model runs: the executor returns random token ids after ``prepare``. Timed per call in CPU
time of the process (``time.process_time``), reported as the mean over the decode steps
that hold all 256 sequences and over all decode steps.

Each run is a fresh process with one torch thread; with ``--baseline DIR`` (another
checkout, e.g. ``git archive BASE src | tar -x -C /tmp/base``) the two alternate, ``--rounds``
times, and the table shows medians, the best run and the ratios::

    python benchmarks/host_step.py --baseline /tmp/base --rounds 5
    python benchmarks/host_step.py --quick      # 32 small requests (the smoke test)

``--device cuda`` packs into pinned host buffers and copies to the GPU, as in production (the
runner is built with ``enforce_eager``; the static inputs and the do-nothing graphs are this
script's): the host cost of a step's copy and fences is then included.
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
from typing import Any

# Run from a plain checkout (`python benchmarks/NAME.py` at the repository root, no install).
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(1, str(REPO / "benchmarks"))  # the sibling _alternating.py, however this runs

from _alternating import alternate, comparison_table

VOCAB = 10000
BLOCK_SIZE = 256
MAX_NUM_SEQS = 512
MAX_MODEL_LEN = 4096


def measure(checkout: Path, cache_dir: Path, *, quick: bool, device: str) -> dict[str, float]:
    """One run in this process, importing pagedinfer from ``checkout/src``."""
    sys.path.insert(0, str(checkout / "src"))
    import torch

    from pagedinfer import Engine, SamplingParams
    from pagedinfer.adapters.cuda_graph import CudaGraphDecodeRunner, DecodeGraphLayout
    from pagedinfer.adapters.models import random_checkpoint
    from pagedinfer.adapters.step_inputs import StepPacker
    from pagedinfer.domain.step_output import StepOutput

    torch.set_num_threads(1)
    model = cache_dir / "host-step"
    if not (model / "config.json").exists():
        random_checkpoint.build_random_checkpoint(
            model,
            "tiny",
            seed=0,
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    engine = Engine(
        str(model),
        device=device,
        enforce_eager=True,
        kv_block_size=BLOCK_SIZE,
        num_kv_blocks=2048,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=16384,
        max_model_len=MAX_MODEL_LEN,
    )
    runner: Any = engine._executor
    # Pack as on CUDA: the graph's static inputs, and "graphs" that replay nothing.
    layout = DecodeGraphLayout.for_limits(
        max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE
    )
    runner.packer = StepPacker(runner.device, sampled=True, zero_copy=False)
    static = runner.packer.attach_graph_inputs(layout.largest, layout.table_width, MAX_NUM_SEQS)
    graphs = {bucket: _NoReplay() for bucket in layout.buckets}
    outputs = {bucket: torch.zeros(bucket, 1, device=device) for bucket in layout.buckets}
    runner.graph_runner = CudaGraphDecodeRunner(layout, static, graphs, outputs)

    rng = random.Random(0)
    count, low, high = (32, 16, 128) if quick else (256, 100, 1024)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(low, high))
        for _ in range(count)
    ]
    prepare: list[tuple[bool, int, float]] = []  # (decode, sequences, seconds) per step
    record: list[tuple[bool, int, float]] = []
    clock = time.process_time

    class HostOnly:
        """The runner's ``prepare``, then random token ids instead of the model."""

        num_kv_blocks = runner.num_kv_blocks
        reads_carried_tokens = False
        is_sleeping = False

        def execute(self, plan: Any) -> Any:
            began = clock()
            runner.prepare(plan)
            prepare.append((not plan.is_prefill, plan.num_seqs, clock() - began))
            return StepOutput([rng.randrange(VOCAB) for _ in range(plan.num_samples)])

        def launch(self, plan: Any) -> Any:
            output = self.execute(plan)
            return lambda: output

        def close(self) -> None:
            runner.close()

    engine._executor = HostOnly()  # type: ignore[assignment]
    timed_record = engine._record

    def record_step(plan: Any, output: Any, seconds: float) -> None:
        began = clock()
        timed_record(plan, output, seconds)
        record.append((not plan.is_prefill, plan.num_seqs, clock() - began))

    engine._record = record_step  # type: ignore[method-assign]
    began = clock()
    engine.generate(prompts, params, use_tqdm=False)
    generate = clock() - began
    engine.close()
    full = count
    return {
        "prepare_full_us": _mean_us(prepare, full),
        "prepare_decode_us": _mean_us(prepare, None),
        "record_full_us": _mean_us(record, full),
        "record_decode_us": _mean_us(record, None),
        "generate_s": generate,
        "full_steps": sum(1 for decode, n, _ in record if decode and n == full),
    }


class _NoReplay:
    def replay(self) -> None:
        pass


def _mean_us(steps: list[tuple[bool, int, float]], num_seqs: int | None) -> float:
    chosen = [s for decode, n, s in steps if decode and (num_seqs is None or n == num_seqs)]
    return statistics.fmean(chosen) * 1e6 if chosen else float("nan")


def run(checkout: Path, cache_dir: Path, quick: bool, device: str) -> dict[str, float]:
    """One measurement in a fresh process (so neither version warms the other's caches)."""
    command = [sys.executable, __file__, "--worker", str(checkout), "--cache-dir", str(cache_dir)]
    result = subprocess.run(
        [*command, "--device", device, *(["--quick"] if quick else [])],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    values: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return values


ROWS = (
    ("prepare_full_us", "pack inputs, decode step of all sequences (µs)"),
    ("prepare_decode_us", "pack inputs, any decode step (µs)"),
    ("record_full_us", "bookkeeping, decode step of all sequences (µs)"),
    ("record_decode_us", "bookkeeping, any decode step (µs)"),
    ("generate_s", "whole run, no model (s)"),
)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="32 small requests (smoke test)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (pinned copies)")
    parser.add_argument("--cache-dir", type=Path, default=Path(".bench-cache"))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cache_dir = args.cache_dir.resolve()
    if args.worker is not None:
        print(json.dumps(measure(args.worker, cache_dir, quick=args.quick, device=args.device)))
        return 0
    checkouts = {"this checkout": REPO}
    if args.baseline is not None:
        checkouts = {"baseline": args.baseline.resolve(), **checkouts}
    results = alternate(
        checkouts, args.rounds, lambda checkout: run(checkout, cache_dir, args.quick, args.device)
    )
    print()
    print("\n".join(comparison_table(results, ROWS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
