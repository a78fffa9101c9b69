"""torch CPU thread counts side by side: ``pagedinfer demo`` in fresh processes, alternating.

Each run is ``python -m pagedinfer demo --num-threads N`` (8 prompts, 64 tokens each, the
random-weight ``small`` Qwen3 checkpoint), one process per run so that every run starts with
torch's own thread pool; the settings alternate run by run, so that the machine's other load
falls on all of them alike. The table shows the median and the range of the end-to-end and
decode throughputs the demo prints, and the load average before and after::

    python benchmarks/threads.py --threads 2 1 --rounds 5

``--threads 0`` runs the demo's default (no ``--num-threads`` flag).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_RESULT = re.compile(r"\(([\d.]+) tok/s end to end; prefill (\d+) tok/s, decode (\d+) tok/s\)")


def run_demo(threads: int, checkpoint_dir: str) -> tuple[float, float]:
    """(end-to-end tok/s, decode tok/s) of one demo run in a fresh process."""
    command = [sys.executable, "-m", "pagedinfer", "demo", "--checkpoint-dir", checkpoint_dir]
    if threads:
        command += ["--num-threads", str(threads)]
    environment = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    done = subprocess.run(command, capture_output=True, text=True, env=environment, check=True)
    match = _RESULT.search(done.stdout)
    if match is None:
        raise RuntimeError(f"no throughput in the demo's output:\n{done.stdout[-2000:]}")
    return float(match.group(1)), float(match.group(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--checkpoint-dir", default=".demo-model")
    args = parser.parse_args()
    run_demo(1, args.checkpoint_dir)  # builds the checkpoint once; not counted
    results: dict[int, list[tuple[float, float]]] = {n: [] for n in args.threads}
    load_before = os.getloadavg()[0]
    for _ in range(args.rounds):
        for threads in args.threads:
            results[threads].append(run_demo(threads, args.checkpoint_dir))
    load_after = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0))
    print(
        f"{cores} CPUs in the affinity mask; load average {load_before:.1f} before, "
        f"{load_after:.1f} after; {args.rounds} alternating rounds\n"
    )
    print("| --num-threads | end to end tok/s (median) | range | decode tok/s (median) | range |")
    print("|---|---:|---:|---:|---:|")
    for threads, runs in results.items():
        total = [run[0] for run in runs]
        decode = [run[1] for run in runs]
        print(
            f"| {threads or 'default'} | {statistics.median(total):.0f} | "
            f"{min(total):.0f}-{max(total):.0f} | {statistics.median(decode):.0f} | "
            f"{min(decode):.0f}-{max(decode):.0f} |"
        )


if __name__ == "__main__":
    main()
