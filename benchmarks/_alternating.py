"""Shared by the before/after benchmarks (``cpu_step.py``, ``host_step.py``): checkouts
measured in turns, each run a fresh process, and the table of their medians.

Not a benchmark itself (the leading underscore keeps it out of the list of scripts).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

Measurements = dict[str, list[dict[str, float]]]


def alternate(
    checkouts: dict[str, Path], rounds: int, run: Callable[[Path], dict[str, float]]
) -> Measurements:
    """``rounds`` runs of every checkout, in turns (so drifts of the machine hit all alike)."""
    results: Measurements = {name: [] for name in checkouts}
    for round_index in range(rounds):
        for name, checkout in checkouts.items():
            results[name].append(run(checkout))
            print(f"round {round_index + 1} {name}: {results[name][-1]}", flush=True)
    return results


def comparison_table(results: Measurements, rows: Sequence[tuple[str, str]]) -> list[str]:
    """Markdown: a row per ``(key, label)``, median / best per checkout, and with two
    checkouts (baseline first) the ratio of their medians."""
    names = list(results)
    pair = len(names) == 2
    header = " | ".join(f"{name} (median / best)" for name in names)
    lines = [
        f"| measure | {header} |" + (" baseline / this (median) |" if pair else ""),
        "|---|" + "---:|" * (len(names) + pair),
    ]
    for key, label in rows:
        cells = []
        medians = []
        for name in names:
            values = [run_result[key] for run_result in results[name]]
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:.3g} / {min(values):.3g}")
        ratio = f" {medians[0] / medians[1]:.2f}x |" if pair else ""
        lines.append(f"| {label} | {' | '.join(cells)} |{ratio}")
    return lines
