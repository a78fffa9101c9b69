"""``python -m pagedinfer.adapters.kernels.preflight``: see :mod:`.run`. Exit status 1 when a
configuration fails to compile or needs more shared memory than its target has."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedinfer.adapters.kernels import interpreter_enabled
from pagedinfer.adapters.kernels.preflight.report import describe_failure, markdown_table, summary
from pagedinfer.adapters.kernels.preflight.run import run_preflight
from pagedinfer.adapters.kernels.target import KNOWN_TARGETS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedinfer.adapters.kernels.preflight",
        description="Compile every Triton kernel configuration the engine launches for each "
        "GPU target, on the CPU; fail on compile errors and shared memory over the limit.",
    )
    parser.add_argument(
        "--targets", default="80,89,90",
        help=f"compute capabilities, comma-separated, of {sorted(KNOWN_TARGETS)} (default: "
        "%(default)s)",
    )  # fmt: skip
    parser.add_argument("--jobs", type=int, default=2, help="compiler processes (default: 2)")
    parser.add_argument(
        "--markdown", type=Path, help="write the registers and spills table to this file"
    )
    args = parser.parse_args(argv)
    if interpreter_enabled():
        parser.error("TRITON_INTERPRET is set: the preflight compiles kernels; unset it")
    try:
        targets = [int(t) for t in args.targets.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--targets {args.targets!r}: give capabilities such as 80,89,90")
    unknown = [t for t in targets if t not in KNOWN_TARGETS]
    if unknown or not targets:
        parser.error(f"--targets {args.targets!r}: known are {sorted(KNOWN_TARGETS)}")
    report = run_preflight(targets, jobs=args.jobs)
    for failure in report.failures:
        print(describe_failure(failure), file=sys.stderr)
    print(summary(report))
    if args.markdown is not None:
        args.markdown.write_text(markdown_table(report))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
