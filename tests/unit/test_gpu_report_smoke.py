"""``make bench-gpu``'s script and the step profile on the CPU (``--device cpu``, tiny shapes):
every section runs and the markdown has them all. The numbers mean nothing here; on a GPU the
same code measures the real thing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_on_cpu(script: str, out: Path, *options: str) -> str:
    """Run ``benchmarks/<script>`` on tiny CPU shapes from ``out``'s folder; its markdown."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # the script finds src/ itself
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / script),
            "--device=cpu",
            f"--out={out}",
            f"--cache-dir={out.parent}",
            "--bandwidth-mb=16",
            *options,
        ],
        cwd=out.parent,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return out.read_text()


def test_gpu_report_cpu_smoke_run(tmp_path: Path) -> None:
    report = run_on_cpu("gpu_report.py", tmp_path / "report.md", "--baselines=generate")
    for heading in (
        "# pagedinfer GPU report",
        "## Device",
        "## GPU tests (fast subset)",
        "## Throughput: nano-vLLM's workload",
        "## Profile: one decode step and one prefill step",
        "## Throughput against transformers",
        "## HBM bound",
        "## FP8 checkpoint (block-wise)",
    ):
        assert heading in report, heading
    assert "This section failed" not in report
    assert "copy bandwidth" in report and "of the bound" in report
    assert "| decode |" in report and "| prefill (256-token budget) |" in report
    assert "transformers generate (padded" in report


def test_step_profile_cpu_smoke_run(tmp_path: Path) -> None:
    profile = run_on_cpu(
        "step_profile.py", tmp_path / "profile.md", "--cprofile", "--top=5", "--timeline-steps=2"
    )
    for part in (
        "First timed run",
        "Second timed run",
        "Triton kernel variants compiled during this run",
        "| decode batch |",
        "| wait for sampled ids (+ logprobs) |",
        "Host profile (cProfile, own time)",
        "decode steps of 4 sequences",
    ):
        assert part in profile, part
