"""``make bench-gpu``'s script and the step profile on the CPU (``--device cpu``, tiny shapes):
every section runs and the markdown has them all. The numbers mean nothing here; on a GPU the
same code measures the real thing."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

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
    report = run_on_cpu(
        "gpu_report.py", tmp_path / "report.md", "--async-rounds=1", "--spec-rounds=1"
    )
    for heading in (
        "# pagedinfer GPU report",
        "## Device",
        "## GPU tests (fast subset)",
        "## Throughput: nano-vLLM's workload",
        "## Profile: one decode step and one prefill step",
        "## Throughput against transformers (settings swept)",
        "## HBM bound",
        "## FP8 KV cache",
        "## FP8 checkpoint (block-wise)",
        "## Async scheduling (one step in flight)",
        "## Structured outputs (0 % and 50 % JSON-schema constrained)",
        "## Speculative decoding (batch 1 and 8)",
    ):
        assert heading in report, heading
    assert "This section failed" not in report
    assert "copy bandwidth" in report and "of the bound" in report
    assert "bytes read plus bytes written" in report  # the bound's reads vs the copy's r+w
    assert "| whole workload |" in report and "async / sync" in report
    assert "| decode |" in report and "| prefill (256-token budget) |" in report
    # The sweep: the probe's table (pagedinfer and the setting, from its own process), then
    # the best setting on the whole workload, labelled with its settings.
    assert "| pagedinfer | pagedinfer (torch, eager) |" in report
    assert "| transformers | generate: padded, static cache |" in report
    assert "with loading and warm-up" in report
    assert "| transformers generate: padded, static cache |" in report
    # Three bounds (bf16 weights and cache, FP8 cache, FP8 weights), each its own.
    assert report.count("of the bound**") == 3
    assert "KV blocks of 16 tokens (4.00x the" in report  # FP8 cache vs float32 (CPU)
    assert "| 50% |" in report
    assert "| loop b=8 | ngram k=3 |" in report and "| no-loop b=1 | draft=small k=3 |" in report


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


def test_the_hbm_bound_counts_what_a_decode_step_reads(make_checkpoint: Any) -> None:
    """Every tensor once per step but the input embedding, of which one row per decoded
    token; a tied LM head reads that matrix whole (an untied one is its own tensor)."""
    import importlib

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        gpu_report = importlib.import_module("gpu_report")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    hidden, vocab = 64, 512  # the tiny preset, float32 on disk
    embedding, row = vocab * hidden * 4, hidden * 4
    for tied in (True, False):
        checkpoint = make_checkpoint("tiny", tie_word_embeddings=tied)
        total = gpu_report.checkpoint_bytes(checkpoint)
        step = total if tied else total - embedding
        assert gpu_report.decode_read_bytes(checkpoint) == (step, row)
        facts = gpu_report.model_facts(checkpoint, torch.float32)
        # Two requests of 4-token prompts, 3 and 2 output tokens: 2 decode steps reading
        # contexts 5, 6 (the first) and 5 (the second): 3 rows, 16 tokens of K/V.
        workload = gpu_report.throughput.Workload([[1] * 4, [2] * 4], [3, 2], 0.6)
        bound = gpu_report.hbm_bound(workload, facts, bandwidth=1.0)
        assert bound["weight_bytes"] == 2 * step + 3 * row
        assert bound["kv_bytes"] == 16 * facts.kv_bytes_per_token


def _gpu_report() -> Any:
    import importlib

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module("gpu_report")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


@pytest.mark.parametrize("full_run", ["fits", "times out"])
def test_the_transformers_sweep_reports_the_best_setting_by_name(
    monkeypatch: pytest.MonkeyPatch, full_run: str
) -> None:
    """The CUDA sweep without a GPU: every setting's probe is faked (one fails, one is the
    fastest); the fastest runs the whole workload, or the comparison falls back to the probe
    and says so."""
    gpu_report = _gpu_report()
    workload = gpu_report.throughput.Workload([[1] * 8] * 4, [16, 24, 32, 40], 0.6)
    settings = gpu_report.hf_settings(True, 4)
    fastest = settings[1]
    calls: list[tuple[str, int]] = []

    def fake(setting: Any, model: str, work: Any, args: Any, timeout: float) -> Any:
        calls.append((setting.label, work.output_tokens))
        assert timeout > 0
        if setting.label == settings[0].label:
            return None, "failed: RuntimeError: no GPU here"
        if work.output_tokens == workload.output_tokens and full_run == "times out":
            return None, f"stopped after {timeout:.0f} s (the budget)"
        speed = 1000.0 if setting.label == fastest.label else 100.0
        result = gpu_report.throughput.Result(
            f"transformers {setting.label}", work.output_tokens, work.output_tokens / speed
        )
        return result, "1 s with loading and warm-up"

    monkeypatch.setattr(gpu_report, "hf_subprocess", fake)
    report = gpu_report.Report()
    args = argparse.Namespace(device=torch.device("cuda"), hf_budget=300)
    ours = gpu_report.throughput.Result("pagedinfer (triton, CUDA graphs)", 112, 0.01)
    probe_tokens = sum(max(1, n // 8) for n in workload.output_lens)
    ours_probe = gpu_report.throughput.Result(
        "pagedinfer (triton, CUDA graphs)", probe_tokens, 0.001
    )
    gpu_report.sweep_transformers(report, args, "model", workload, ours, ours_probe)
    text = report.text()

    assert calls[:-1] == [(s.label, probe_tokens) for s in settings]
    assert calls[-1] == (fastest.label, workload.output_tokens)
    assert f"Best on the probe: **{fastest.label}**" in text
    assert "failed: RuntimeError: no GPU here" in text
    assert "max_requests_per_batch=128" in fastest.label
    final = text.split("Best on the probe")[1]
    if full_run == "fits":
        assert f"| transformers {fastest.label} | 112 |" in final
        assert "| pagedinfer (triton, CUDA graphs) | 112 |" in final
    else:
        assert "stopped after" in final and "the comparison below is on the probe" in final
        assert f"| transformers {fastest.label} | {probe_tokens} |" in final
        assert f"| pagedinfer (triton, CUDA graphs) | {probe_tokens} |" in final


def test_budgeted_gpu_report_runs_inside_its_budget_on_the_cpu(tmp_path: Path) -> None:
    """``--budget-s``: sections run most needed first, each written to the output folder as
    it ends; those that would not fit (and those whose inputs did not run) are skipped and
    listed; the run ends inside its budget (its own clock starts before torch's import)."""
    budget = 30
    report = run_on_cpu(
        "gpu_report.py",
        tmp_path / "report.md",
        f"--budget-s={budget}",
        "--async-rounds=1",
        "--spec-rounds=1",
    )
    folder = tmp_path / "report"
    assert (folder / "00-device.md").read_text().startswith("\n## Device")
    assert (folder / "report.md").read_text() == report
    assert "This section failed" not in report
    budget_table = report.split("## Budget", 1)[1]
    assert "| Device |" in budget_table and "| ran |" in budget_table
    # The transformers sweep comes last and alone needs a minute on the CPU: never fits.
    assert "| Throughput against transformers (settings swept) | 60 | - | skipped:" in report
    used = float(budget_table.split("used ", 1)[1].split(" s", 1)[0])
    assert used <= budget + 10  # a section may overrun its estimate a little
    ran = [line for line in budget_table.splitlines() if line.endswith("| ran |")]
    assert len(list(folder.glob("[0-9][0-9]-*.md"))) == len(ran)
