"""Batch-1 latency on the CPU: decode tok/s and time to first token of a single request,
side by side with another checkout (a baseline).

The model is a random-weight Qwen3 of ~29M parameters (vocabulary 20480 with a tokenizer,
hidden 512, 6 layers, 8 query / 4 KV heads of 64, MLP 1536, tied embeddings) in float32,
the size issue 24 compared with llama.cpp. Each run is a fresh process with one torch
thread; it warms the engine up, then, ``--reps`` times, ``Engine.generate`` of one new prompt
(``--prompt-len`` random tokens, greedy, ``ignore_eos``) for 1 token and of another for
``--output-len`` + 1 tokens:

* **time to first token**: the 1-token generate (prefill, LM head, sampling, detokenizing);
* **decode**: the difference of the two over ``--output-len`` (ms per token of the decode
  steps alone; tok/s is its inverse);

medians over the repetitions, wall-clock time and the process's CPU time. Then one more
request with timers around the parts of a step (the forward, the LM head, sampling, packing
the inputs, scheduling, the engine's bookkeeping): milliseconds per decode step, the rest of
the step's wall time being the engine loop's own Python. Then that request's last decode
step replayed on its own inputs: as is, the time inside its matmuls, and the rest run warm
(matmuls stubbed). Last, the floor: bare matmuls of a
1-row input over every weight matrix of the model once (the bytes a decode step must read),
and for comparison one layer's matrices as often as there are layers (a working set that
stays in the caches, which is what a loop over one layer measures).

With ``--baseline DIR`` (another checkout, e.g. ``git worktree add /tmp/base main``) the two
alternate, ``--rounds`` times; the table shows medians, the best run and the ratios::

    python benchmarks/batch1_latency.py --baseline /tmp/base --rounds 5
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run from a plain checkout (`python benchmarks/NAME.py` at the repository root, no install):
# this repository's src/ comes first on the import path.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(1, str(REPO / "benchmarks"))  # the sibling _alternating.py, however this runs

from _alternating import alternate, comparison_table

MODEL_NAME = "qwen3-29m"
MODEL_SHAPE: dict[str, Any] = {
    "vocab_size": 20480,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "rope_theta": 1_000_000.0,
    "initializer_range": 0.02,
}

# Parts of a step, timed by wrappers around these methods: (owner, attribute, phase). The
# owner is resolved in the run; a method a checkout lacks is skipped.
PHASES = (
    ("scheduler", "schedule", "schedule"),
    ("runner", "prepare", "pack inputs"),
    ("runner", "_run_model", "forward (decoder layers)"),
    ("model", "compute_logits", "LM head"),
    ("runner", "_sample", "sample"),
    ("engine", "_execute", "execute (all of the runner)"),
    ("engine", "_record", "bookkeeping + detokenize"),
)


def build_model(cache_dir: Path) -> Path:
    """The benchmark's checkpoint (built once, with this checkout's builder)."""
    from pagedinfer.adapters.models import random_checkpoint

    path = cache_dir / MODEL_NAME
    if not (path / "config.json").exists():
        random_checkpoint.build_random_checkpoint(
            path, "small", seed=0, with_tokenizer=True, **MODEL_SHAPE
        )
    return path


class PhaseTimers:
    """Wall-clock seconds per phase, from wrappers around bound methods (instance
    attributes shadowing the class's; removed by :meth:`unwrap`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.last_args: dict[str, tuple[Any, ...]] = {}  # of each phase's latest call
        self._wrapped: list[tuple[Any, str]] = []

    def wrap(self, owner: Any, attribute: str, phase: str) -> None:
        original: Callable[..., Any] | None = getattr(owner, attribute, None)
        if original is None:
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.last_args[phase] = args
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - began

        object.__setattr__(owner, attribute, timed)
        self._wrapped.append((owner, attribute))

    def unwrap(self) -> None:
        for owner, attribute in reversed(self._wrapped):
            object.__delattr__(owner, attribute)
        self._wrapped.clear()


def measure(checkout: Path, cache_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """One run in this process, importing pagedinfer from ``checkout/src``."""
    sys.path.insert(0, str(checkout / "src"))
    import torch

    from pagedinfer import Engine, SamplingParams

    torch.set_num_threads(1)
    model = cache_dir / MODEL_NAME
    engine = Engine(str(model), device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=8)
    rng = random.Random(0)
    vocab = MODEL_SHAPE["vocab_size"]

    def prompt() -> list[int]:  # a new one each time: no prefix-cache hits
        return [rng.randrange(1, vocab) for _ in range(args.prompt_len)]

    def timed_generate(max_tokens: int) -> tuple[float, float]:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        request = prompt()
        wall, cpu = time.perf_counter(), time.process_time()
        (output,) = engine.generate([request], params, use_tqdm=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert len(output.outputs[0].token_ids) == max_tokens
        return wall, cpu

    timed_generate(32)  # warm-up
    first_wall, first_cpu, decode_wall, decode_cpu = [], [], [], []
    for _ in range(args.reps):
        wall_1, cpu_1 = timed_generate(1)
        wall_n, cpu_n = timed_generate(args.output_len + 1)
        first_wall.append(wall_1)
        first_cpu.append(cpu_1)
        decode_wall.append((wall_n - wall_1) / args.output_len)
        decode_cpu.append((cpu_n - cpu_1) / args.output_len)

    # Where a decode step's time goes: one more request, instrumented.
    runner: Any = engine._executor  # internal: the single-process ModelRunner
    owners = {"scheduler": engine.scheduler, "runner": runner, "model": runner.model}
    owners["engine"] = engine
    timers = PhaseTimers()
    for owner, attribute, phase in PHASES:
        timers.wrap(owners[owner], attribute, phase)
    try:
        wall_1, _ = timed_generate(1)
        timers.seconds.clear()
        wall_n, _ = timed_generate(args.output_len + 1)
    finally:
        timers.unwrap()
    floor_ms, resident_ms = weight_stream(runner.model)
    # The inputs of the last forward: a decode step's.
    replay = replayed_step(runner.model, timers.last_args["forward (decoder layers)"][0])
    engine.close()
    steps = args.output_len + 1  # the prefill step's share is small next to 256 decode steps
    result = {
        "decode_ms": statistics.median(decode_wall) * 1e3,
        "decode_cpu_ms": statistics.median(decode_cpu) * 1e3,
        "ttft_ms": statistics.median(first_wall) * 1e3,
        "ttft_cpu_ms": statistics.median(first_cpu) * 1e3,
        "step_ms": wall_n / steps * 1e3,
        "floor_ms": floor_ms,
        "resident_ms": resident_ms,
        **replay,
    }
    for phase, seconds in timers.seconds.items():
        result[f"phase:{phase}"] = seconds / steps * 1e3
    return result


def weight_stream(model: Any, rounds: int = 20) -> tuple[float, float]:
    """The floor of a decode step: ms for one pass of bare matmuls of a 1-row input over
    every weight matrix of ``model`` (each once; a tied LM head is the embedding), nothing
    else in between; and the same for one decoder layer's matrices done as often as there
    are layers (a working set that stays in the caches, for comparison)."""
    import torch
    import torch.nn.functional as F

    weights = [p for p in model.parameters() if p.dim() == 2]
    layer = [p for p in model.model.layers[0].parameters() if p.dim() == 2]
    repeated = layer * len(model.model.layers)
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}

    def timed(matrices: list[torch.Tensor]) -> float:
        best = float("inf")
        with torch.inference_mode():
            for _ in range(3):
                began = time.perf_counter()
                for _ in range(rounds):
                    for w in matrices:
                        F.linear(inputs[w.shape[1]], w)
                best = min(best, (time.perf_counter() - began) / rounds)
        return best * 1e3

    timed(weights)  # warm-up
    return timed(weights), timed(repeated)


def replayed_step(model: Any, inputs: Any, rounds: int = 20) -> dict[str, float]:
    """One decode step's forward, LM head and argmax, replayed on its own inputs (medians of
    5 x ``rounds`` passes, ms): as is; the time spent inside its matmuls, timed in place;
    and the rest warm, i.e. the same step with every matmul replaced by a stored result (its
    small ops then find their data and code in the caches, which a real step's 117 MB of
    weights flush)."""
    import torch
    import torch.nn.functional as F

    real_linear = F.linear
    stored: dict[tuple[int, ...], torch.Tensor] = {}
    inside = [0.0]

    def timed_linear(x: torch.Tensor, w: torch.Tensor, b: Any = None) -> torch.Tensor:
        began = time.perf_counter()
        out = real_linear(x, w, b)
        inside[0] += time.perf_counter() - began
        return out

    def stored_linear(x: torch.Tensor, w: torch.Tensor, b: Any = None) -> torch.Tensor:
        key = (*x.shape, *w.shape)
        if key not in stored:
            stored[key] = real_linear(x, w, b)
        return stored[key]

    def step() -> None:
        inputs.meta.derived.clear()  # what the attention backend derives per step
        hidden = model(inputs.input_ids, inputs.positions, inputs.meta)
        model.compute_logits(hidden).argmax(dim=-1)

    def timed(linear: Any) -> float:
        times = []
        F.linear = linear  # type: ignore[assignment]
        try:
            with torch.inference_mode():
                step()
                for _ in range(5):
                    inside[0] = 0.0
                    began = time.perf_counter()
                    for _ in range(rounds):
                        step()
                    times.append((time.perf_counter() - began) / rounds * 1e3)
        finally:
            F.linear = real_linear  # type: ignore[assignment]
        return statistics.median(times)

    whole = timed(real_linear)
    timed(timed_linear)
    matmuls = inside[0] / rounds * 1e3
    return {"replay_ms": whole, "replay_mm_ms": matmuls, "replay_rest_ms": timed(stored_linear)}


def run(checkout: Path, cache_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """One measurement in a fresh process (so neither version warms the other's caches)."""
    command = [sys.executable, __file__, "--worker", str(checkout), "--cache-dir", str(cache_dir)]
    command += ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
    command += ["--reps", str(args.reps)]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    values: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return values


def breakdown(results: list[dict[str, float]]) -> list[str]:
    """Milliseconds per decode step by phase (medians over the runs); the execute phase
    contains the forward, the LM head, sampling and packing."""
    step = statistics.median(r["step_ms"] for r in results)
    lines = ["| part of a decode step | ms per step | share |", "|---|---:|---:|"]
    for _, _, phase in PHASES:
        key = f"phase:{phase}"
        if key in results[0]:
            value = statistics.median(r[key] for r in results)
            lines.append(f"| {phase} | {value:.3f} | {value / step:.0%} |")
    lines.append(f"| whole step (wall, instrumented) | {step:.3f} | 100% |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3, help="requests of each kind per run")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--cache-dir", type=Path, default=Path(".bench-cache"))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cache_dir = args.cache_dir.resolve()
    if args.worker is not None:
        print(json.dumps(measure(args.worker, cache_dir, args)))
        return 0
    build_model(cache_dir)
    checkouts = {"this checkout": REPO}
    if args.baseline is not None:
        checkouts = {"baseline": args.baseline.resolve(), **checkouts}
    results = alternate(checkouts, args.rounds, lambda checkout: run(checkout, cache_dir, args))
    print()
    rows = (
        ("decode_ms", "decode, ms per token (wall)"),
        ("decode_cpu_ms", "decode, ms per token (CPU time)"),
        ("ttft_ms", "time to first token, ms (wall)"),
        ("ttft_cpu_ms", "time to first token, ms (CPU time)"),
        ("replay_ms", "a decode step replayed (forward, LM head, argmax), ms"),
        ("replay_mm_ms", "... of which inside its matmuls, ms"),
        ("replay_rest_ms", "... the rest, run warm (matmuls stubbed), ms"),
        ("floor_ms", "floor: bare matmuls over all weights, ms per pass"),
        ("resident_ms", "for comparison: one layer's matmuls x layers (cache-resident), ms"),
    )
    print("\n".join(comparison_table(results, rows)))
    print()
    for name, runs in results.items():
        rates = sorted(1e3 / run_result["decode_ms"] for run_result in runs)
        median = statistics.median(rates)
        print(f"{name}: decode {median:.1f} tok/s (median of runs), {rates[-1]:.1f} best")
    print()
    for name, runs in results.items():
        print(f"{name}, where a decode step's time goes:\n")
        print("\n".join(breakdown(runs)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
