"""What checking a checkpoint for NaN and infinity costs at load (``weight_check``).

The biggest checkpoint the tests use, Qwen3-0.6B's shape with random weights (28 layers,
hidden 1024, vocab 151,936, bfloat16 on disk), dense and quantized (GPTQ 4-bit, block FP8),
is loaded into a float32 CPU model with ``weight_check`` ``"none"`` (the baseline: no
check), ``"default"`` (scales, norms, biases) and ``"all"`` (every tensor). The model is
built outside the timed part; only ``load_weights`` (read, check, convert, copy, finish the
quantized layers) is timed. The runs interleave the three settings, ``--repeats`` rounds,
and report each setting's median and fastest run, and the cost of each check against the
baseline's (of the fastest runs: the machine may be shared, and noise only adds time), and
the seconds the check itself takes (the tensors already in memory: the least noisy
measure). Each round starts with another setting. The page
cache is warm after the first round (the checkpoint is read from memory, which makes the
check's share larger than it is from disk).

    python benchmarks/load_check.py                     # dense, gptq and fp8, markdown
    python benchmarks/load_check.py --formats dense --repeats 7

The checkpoints are built once in ``--cache`` (default ``.bench-cache/load-check``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

CHECKS = ("none", "default", "all")


def checkpoint(cache: Path, preset: str, fmt: str) -> Path:
    """The dense random checkpoint of ``preset``, or it quantized in ``fmt``, built once."""
    from pagedinfer.adapters.models.quantized_checkpoint import write_quantized_checkpoint
    from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

    dense = cache / preset / "dense"
    if not (dense / "config.json").exists():
        build_random_checkpoint(dense, preset)
    if fmt == "dense":
        return dense
    target = cache / preset / fmt
    if not (target / "config.json").exists():
        options: dict[str, Any] = {"group_size": 128} if fmt == "gptq" else {"block": (128, 128)}
        write_quantized_checkpoint(dense, target, fmt, **options)  # type: ignore[arg-type]
    return target


def load_seconds(path: Path, check: str) -> float:
    from pagedinfer.adapters.attention import create_backend
    from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS
    from pagedinfer.adapters.models.loader import load_weights
    from pagedinfer.adapters.models.registry import build_model, read_model_config

    model = build_model(
        read_model_config(path),
        parallel=SINGLE_PROCESS,
        backend=create_backend("torch", 16),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    started = time.perf_counter()
    load_weights(model, path, check=check)  # type: ignore[arg-type]
    seconds = time.perf_counter() - started
    del model
    return seconds


def check_seconds(path: Path, check: str) -> float:
    """The seconds the check itself takes: counting the non-finite values of the tensors
    ``check`` reads, each already in memory (the least noisy measure of its cost)."""
    from safetensors import safe_open

    from pagedinfer.adapters.models.finite import checks_tensor, count_nonfinite

    total = 0.0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = handle.get_tensor(name)
                if checks_tensor(name, tensor, check):  # type: ignore[arg-type]
                    started = time.perf_counter()
                    count_nonfinite(tensor)
                    total += time.perf_counter() - started
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--formats", nargs="+", default=["dense", "gptq", "fp8"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache", type=Path, default=Path(".bench-cache/load-check"))
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, preset {args.preset}")
    print()
    print(
        "| checkpoint | size | `none` median / min (s) | `default` | `all` | default cost "
        "| all cost | check alone, default / all (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for fmt in args.formats:
        path = checkpoint(args.cache, args.preset, fmt)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
        load_seconds(path, "none")  # warm the page cache
        times: dict[str, list[float]] = {check: [] for check in CHECKS}
        for round_ in range(args.repeats):
            for index in range(len(CHECKS)):  # each setting goes first in turn
                check = CHECKS[(round_ + index) % len(CHECKS)]
                times[check].append(load_seconds(path, check))
        alone = {check: check_seconds(path, check) for check in CHECKS[1:]}
        median = {check: statistics.median(values) for check, values in times.items()}
        fastest = {check: min(values) for check, values in times.items()}
        base = fastest["none"]

        def cost(check: str, base: float = base, fastest: dict[str, float] = fastest) -> str:
            return f"{100 * (fastest[check] - base) / base:+.1f} %"

        cells = " | ".join(f"{median[c]:.2f} / {fastest[c]:.2f}" for c in CHECKS)
        checks = f"{alone['default']:.3f} / {alone['all']:.2f}"
        print(
            f"| {fmt} | {size:.0f} MiB | {cells} | {cost('default')} | {cost('all')} | {checks} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
