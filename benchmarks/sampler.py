"""The sampler's two paths side by side: torch ops (ratio form) against the fused race kernel.

A decode step's sampling at Qwen3's vocabulary (151936), bf16 logits, temperature 0.6 (the
report's workload), every row sampled and unseeded. Per path and row count: device time and
host (launch) time per call, both over one loop of calls queued behind a sleep kernel (see
:func:`timed`). Same process, same inputs::

    PYTHONPATH=src python3 benchmarks/sampler.py [--rows 1 64 256] [--iters 50]

Needs CUDA.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch

from pagedinfer.adapters.sampling.batch import NO_SEED, SamplingBatch
from pagedinfer.adapters.sampling.sampler import Sampler

VOCAB = 151936


def timed(call: Callable[[], torch.Tensor], iters: int) -> tuple[float, float]:
    """(device µs per call, host µs per call) of ``iters`` calls in a row.

    A long sleep kernel goes first, so the host queues every call before the device starts on
    them: the events then time the device alone (not the host's launch rate), and the host's
    wall time is the launch cost alone (not waits for a full queue).
    """
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device clock cycles
    start.record()
    began = time.perf_counter()
    for _ in range(iters):
        call()
    host_s = time.perf_counter() - began
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters, host_s * 1e6 / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=0.6)
    args = parser.parse_args()
    device = torch.device("cuda")
    sampler = Sampler(device, seed=0)
    print(f"{torch.cuda.get_device_name()}, vocab {VOCAB}, bf16 logits")
    print("rows  path        device us  host us")
    for rows in args.rows:
        logits = torch.randn(rows, VOCAB, device=device).bfloat16()
        batch = SamplingBatch(
            all_greedy=False,
            temperatures=torch.full((rows,), args.temperature, device=device),
            top_ks=torch.zeros(rows, dtype=torch.int64, device=device),
            top_ps=torch.ones(rows, device=device),
            seeds=torch.full((rows,), NO_SEED, dtype=torch.int64, device=device),
        )
        paths: dict[str, Callable[[torch.Tensor, SamplingBatch], torch.Tensor]] = {
            "torch ops": sampler.sample_with_torch_ops,
            "fused race": sampler.race,
        }
        for name, path in paths.items():
            device_us, host_us = timed(functools.partial(path, logits, batch), args.iters)
            print(f"{rows:4d}  {name:10s}  {device_us:9.1f}  {host_us:7.1f}")


if __name__ == "__main__":
    main()
