"""The preflight's findings as text: failures first, then a markdown table of the shared
memory, registers and spills of the groups compiled through ``ptxas``."""

from __future__ import annotations

from pagedinfer.adapters.kernels.preflight.run import CheckedLaunch, PreflightReport

__all__ = ["describe_failure", "markdown_table", "summary"]

# Constexprs worth a column in the table (the rest are in the sweep cases).
_SHOWN = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_G", "BLOCK_H", "HEAD_DIM_P2", "FP8_FORMAT",
          "STORE_KV", "IEEE", "BLOCK", "BLOCK_D")  # fmt: skip


def _config(checked: CheckedLaunch) -> str:
    launch = checked.result.launch
    values = launch.constexpr_values()
    shown = [f"{name}={values[name]}" for name in _SHOWN if name in values]
    dtypes = sorted({kind for _, kind in launch.signature if kind.startswith("*")})
    return " ".join([*shown, f"warps={launch.num_warps}", f"stages={launch.num_stages}",
                     ",".join(dtypes)])  # fmt: skip


def describe_failure(checked: CheckedLaunch) -> str:
    result = checked.result
    targets = ", ".join(t.name for t in checked.targets)
    if result.error is not None:
        why = result.error
    else:
        over = ", ".join(f"{t.name} has {t.shared_memory}" for t in checked.over_limit())
        why = f"needs {result.shared} bytes of shared memory per block; {over}"
    return (
        f"FAILED {result.launch.kernel} for {targets}: {why}\n"
        f"    config: {_config(checked)}\n    launched by: {', '.join(checked.cases[:4])}"
        + (" ..." if len(checked.cases) > 4 else "")
    )


def summary(report: PreflightReport) -> str:
    targets = sorted({t.name for c in report.checked for t in c.targets})
    failures = report.failures
    return (
        f"GPU preflight: {report.launches} launches recorded, {len(report.checked)} compiles "
        f"for {', '.join(targets)} in {report.seconds:.0f} s: "
        + (f"{len(failures)} FAILED" if failures else "all compiled within shared memory")
    )


def markdown_table(report: PreflightReport) -> str:
    rows = [c for c in report.checked if c.result.registers is not None]
    rows.sort(key=lambda c: (c.result.launch.kernel, -(c.result.registers or 0)))
    lines = [
        "| kernel | configuration | target | registers | spill stores / loads (bytes) "
        "| shared memory (bytes) |",
        "|---|---|---|---:|---:|---:|",
    ]
    for c in rows:
        r = c.result
        lines.append(
            f"| {r.launch.kernel} | {_config(c)} | {r.target.name} | {r.registers} "
            f"| {r.spill_stores} / {r.spill_loads} | {r.shared} |"
        )
    return "\n".join(lines) + "\n"
