"""``make bench-gpu``'s script on the CPU (``--device cpu``, tiny shapes): every section runs
and the markdown report has them all. The numbers mean nothing here; on a GPU the same code
measures the real thing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_report.py"


def test_gpu_report_cpu_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # the script finds src/ itself
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device=cpu",
            f"--out={out}",
            f"--cache-dir={tmp_path}",
            "--baselines=generate",
            "--bandwidth-mb=16",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    report = out.read_text()
    for heading in (
        "# pagedinfer GPU report",
        "## Device",
        "## GPU tests (fast subset)",
        "## Throughput: nano-vLLM's workload",
        "## Profile: one decode step and one prefill step",
        "## Throughput against transformers",
        "## HBM bound",
    ):
        assert heading in report, heading
    assert "This section failed" not in report
    assert "copy bandwidth" in report and "of the bound" in report
    assert "| decode |" in report and "| prefill (256-token budget) |" in report
    assert "transformers generate (padded" in report


def test_step_profile_cpu_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "profile.md"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "step_profile.py"),
            "--device=cpu",
            "--cprofile",
            "--top=5",
            "--timeline-steps=2",
            f"--out={out}",
            f"--cache-dir={tmp_path}",
            "--bandwidth-mb=16",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    profile = out.read_text()
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
