"""Run report sections in priority order inside a time budget, writing each as it ends.

``gpu_report.py --budget-s N`` (``make bench-gpu``) hands :func:`run_sections` its sections,
most urgent first, each with an estimate of its seconds on the device. Before a section starts
the estimate is compared with what is left of the budget: a section that would not fit is
skipped and listed as skipped (the ones after it may still fit). As soon as a section ends its
markdown is written to ``OUT_DIR/NN-<slug>.md`` and the whole report so far to
``OUT_DIR/report.md`` (with the sections still to come listed as not run), so a run killed by
a time limit keeps everything it measured.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = ["BudgetSection", "BudgetState", "run_sections"]


class _Report(Protocol):
    lines: list[str]
    failed: list[str]

    def add(self, *lines: str) -> None: ...

    def section(self, title: str):  # type: ignore[no-untyped-def]  # a context manager
        ...

    def text(self) -> str: ...


@dataclass(frozen=True)
class BudgetSection:
    """One section: its title, its estimated seconds, and what runs it (given the seconds
    left of the budget when it starts, for sections that cut themselves to fit)."""

    title: str
    estimate_s: float
    run: Callable[[float], None]
    # Run it even when it does not fit (the device facts every other section needs).
    always: bool = False
    # Titles of the sections whose results it uses: skipped unless they ran without failing.
    requires: tuple[str, ...] = ()


@dataclass
class BudgetState:
    """What the run did: sections written, skipped, and the seconds each took."""

    budget_s: float
    started: float = field(default_factory=time.perf_counter)
    ran: list[tuple[str, float, float]] = field(default_factory=list)  # title, estimate, took
    skipped: list[tuple[str, float, str]] = field(default_factory=list)  # title, est., why

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:48]


def summary_lines(state: BudgetState, pending: list[BudgetSection]) -> list[str]:
    """The budget table: what ran (estimate vs actual), what was skipped, what is to come."""
    lines = [
        "",
        "## Budget",
        "",
        f"Budget {state.budget_s:.0f} s; used {time.perf_counter() - state.started:.0f} s.",
        "",
        "| section | estimate (s) | took (s) | status |",
        "|---|---:|---:|---|",
    ]
    lines += [f"| {title} | {est:.0f} | {took:.0f} | ran |" for title, est, took in state.ran]
    lines += [f"| {title} | {est:.0f} | - | skipped: {why} |" for title, est, why in state.skipped]
    lines += [
        f"| {section.title} | {section.estimate_s:.0f} | - | not run yet |" for section in pending
    ]
    return lines


def run_sections(
    report: _Report,
    sections: list[BudgetSection],
    budget_s: float,
    out_dir: Path,
    started: float | None = None,
) -> BudgetState:
    """Run ``sections`` in order inside ``budget_s`` seconds (counted from ``started``, a
    ``time.perf_counter()``; default now), writing each as it ends."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = BudgetState(budget_s) if started is None else BudgetState(budget_s, started)
    for index, section in enumerate(sections):
        left = state.left()
        done = {title for title, _, _ in state.ran} - set(report.failed)
        missing = [title for title in section.requires if title not in done]
        if missing:
            state.skipped.append((section.title, section.estimate_s, "its inputs did not run"))
            report.add(
                "",
                f"## {section.title}",
                "",
                f"Skipped: needs {', '.join(missing)}, which did not run.",
            )
            continue
        if not section.always and section.estimate_s > left:
            state.skipped.append((section.title, section.estimate_s, f"{max(left, 0):.0f} s left"))
            report.add(
                "",
                f"## {section.title}",
                "",
                f"Skipped: estimated {section.estimate_s:.0f} s, "
                f"{max(left, 0):.0f} s left of the budget.",
            )
            continue
        first = len(report.lines)
        began = time.perf_counter()
        with report.section(section.title):
            section.run(left)
        state.ran.append((section.title, section.estimate_s, time.perf_counter() - began))
        (out_dir / f"{index:02d}-{slug(section.title)}.md").write_text(
            "\n".join(report.lines[first:]) + "\n"
        )
        partial = report.text() + "\n".join(summary_lines(state, sections[index + 1 :])) + "\n"
        (out_dir / "report.md").write_text(partial)
    return state


# --------------------------------------------------------------------- gpu_report's plan
# The GPU tests of the paths that had never run on a GPU before issue 37 (the preflight's
# FP8 fused kernel, FP8 KV, async scheduling, structured outputs, speculative decoding, the
# quantized GEMMs) and those added since (constraints gated by a reasoning end); the rest of
# tests/gpu ran on the H100 before.
NEW_PATH_TESTS = (
    "tests/gpu/test_fused_kernels_gpu.py",
    "tests/gpu/test_fp8_kv_gpu.py",
    "tests/gpu/test_async_gpu.py",
    "tests/gpu/test_structured_gpu.py",
    "tests/gpu/test_speculative_gpu.py",
    "tests/gpu/test_quantized_gpu.py",
    "tests/gpu/test_skinny_gemm_gpu.py",
    "tests/gpu/test_reasoning_gpu.py",
)

# Estimated seconds per section (engine builds included): CUDA from the H100 run of
# 2026-11 scaled to the budget mode's workload, CPU from the smoke run on 2 busy cores.
ESTIMATES: dict[str, dict[str, float]] = {
    "device": {"cuda": 5, "cpu": 3},
    "tests": {"cuda": 150, "cpu": 1},
    "throughput": {"cuda": 45, "cpu": 10},
    "hbm": {"cuda": 1, "cpu": 1},
    "fp8_kv": {"cuda": 35, "cpu": 3},
    "async": {"cuda": 50, "cpu": 5},
    "fp8_checkpoint": {"cuda": 35, "cpu": 3},
    "gemms": {"cuda": 45, "cpu": 1},
    "speculative": {"cuda": 35, "cpu": 40},
    "structured": {"cuda": 30, "cpu": 5},
    "profile": {"cuda": 30, "cpu": 5},
    "transformers": {"cuda": 90, "cpu": 60},
}


def budgeted_main(args: Any, gr: Any) -> int:
    """``gpu_report.py --budget-s N``: the report's sections, most needed first, in budget.

    ``gr`` is the gpu_report module (its section functions and Report)."""
    kind = "cuda" if args.device.type == "cuda" else "cpu"
    out_dir = Path(args.out_dir or str(Path(args.out).with_suffix("")))
    report = gr.Report()
    report.add("# pagedinfer GPU report (budgeted)", "")
    shared: dict[str, Any] = {"bandwidth": 0.0}

    def estimate(name: str) -> float:
        return ESTIMATES[name][kind]

    def device(left: float) -> None:
        found = gr.versions()
        report.add(f"- device: **{gr.describe_device(args.device)}**")
        report.add(*(f"- {name}: {value}" for name, value in found.items()))
        shared["bandwidth"] = gr.copy_bandwidth(args.device, args.bandwidth_mb)
        report.add(
            "- copy bandwidth (device to device, read + write): "
            f"**{shared['bandwidth'] / 1e9:.0f} GB/s**"
        )

    def tests(left: float) -> None:
        args.test_targets = list(NEW_PATH_TESTS)
        # Leave the sections after it some time: the tests take at most what is left but a
        # minute (and never more than --tests-timeout).
        args.tests_timeout = int(max(30, min(args.tests_timeout, left - 60)))
        gr.run_gpu_tests(report, args)

    def base(left: float) -> None:
        model = gr.throughput.resolve_model(args)
        config = gr.json.loads((Path(model) / "config.json").read_text())
        workload = gr.throughput.make_workload(args, int(config["vocab_size"]))
        shared.update(model=model, workload=workload)
        report.add(
            f"Model: `{args.model or args.random_weights}`; {len(workload.prompts)} requests, "
            f"prompts U{list(args.input_len)}, outputs U{list(args.output_len)} "
            f"({workload.output_tokens} output tokens), temperature {args.temperature}, "
            f"ignore_eos, seed {args.seed}; block size {args.kv_block_size}.",
            "",
        )
        engine = gr.engine_for(model, args, gr.max_len_of(workload))
        try:
            shared["facts"] = gr.model_facts(Path(model), gr.engine_kv_dtype(engine))
            shared["dense_blocks"] = engine.stats().num_kv_blocks
            ours = gr.run_pagedinfer(engine, workload, args)
            shared["ours"] = ours
            report.add(f"- {ours.name}: {ours.throughput:.0f} output tok/s")
            if args.baselines != "none":  # the transformers sweep's probe, for comparison
                shared["ours_probe"] = gr.run_pagedinfer(engine, gr.probe_of(workload), args)
        finally:
            engine.close()
            del engine
            gr.throughput.release_memory(str(args.device))

    def needs(*names: str) -> list[Any]:
        missing = [name for name in names if shared.get(name) is None]
        if missing or not shared["bandwidth"]:
            raise RuntimeError(f"needs the throughput section's results ({', '.join(missing)})")
        return [shared[name] for name in names]

    def hbm(left: float) -> None:
        workload, facts, ours = needs("workload", "facts", "ours")
        bandwidth = shared["bandwidth"]
        bound = gr.hbm_bound(workload, facts, bandwidth)
        report.add(
            *gr.bound_lines("pagedinfer", ours, bound, facts, bandwidth), "", gr.BANDWIDTH_NOTE
        )

    def fp8_kv(left: float) -> None:
        model, workload = needs("model", "workload")
        gr.run_fp8_kv(
            report, args, model, workload, shared["bandwidth"], shared.get("ours"),
            shared.get("dense_blocks"),
        )  # fmt: skip

    def async_scheduling(left: float) -> None:
        model, workload, facts = needs("model", "workload", "facts")
        gr.run_async_scheduling(report, args, model, workload, shared["bandwidth"], facts)

    def fp8_checkpoint(left: float) -> None:
        model, workload = needs("model", "workload")
        gr.run_fp8_checkpoint(
            report, args, model, workload, shared["bandwidth"], shared.get("ours")
        )

    def gemms(left: float) -> None:
        gr.run_decode_gemms(report, args, shared["bandwidth"])

    def speculative(left: float) -> None:
        gr.run_speculative(report, args, needs("model")[0])

    def structured(left: float) -> None:
        gr.run_structured_outputs(report, args)

    def profile(left: float) -> None:
        model, workload, facts = needs("model", "workload", "facts")
        engine = gr.engine_for(model, args, max(gr.max_len_of(workload), args.profile_context + 64))
        try:
            report.add(*gr.profile_steps(engine, facts, args, shared["bandwidth"]))
        finally:
            engine.close()
            del engine
            gr.throughput.release_memory(str(args.device))

    def transformers(left: float) -> None:
        model, workload, ours = needs("model", "workload", "ours")
        if args.baselines == "none":
            report.add("Skipped (`--baselines none`).")
            return
        args.hf_budget = max(30.0, min(float(args.hf_budget), left - 15))  # what is left
        gr.sweep_transformers(report, args, model, workload, ours, shared.get("ours_probe"))

    BASE = "Throughput: nano-vLLM's workload"  # the title the later sections require
    sections = [
        BudgetSection("Device", estimate("device"), device, always=True),
        BudgetSection("GPU tests (paths never run on a GPU)", estimate("tests"), tests),
        BudgetSection(BASE, estimate("throughput"), base),
        BudgetSection("HBM bound", estimate("hbm"), hbm, requires=(BASE,)),
        BudgetSection("FP8 KV cache", estimate("fp8_kv"), fp8_kv, requires=(BASE,)),
        BudgetSection(
            "Async scheduling (one step in flight)",
            estimate("async"),
            async_scheduling,
            requires=(BASE,),
        ),
        BudgetSection(
            "FP8 checkpoint (block-wise)",
            estimate("fp8_checkpoint"),
            fp8_checkpoint,
            requires=(BASE,),
        ),
        BudgetSection(gr.DECODE_GEMMS, estimate("gemms"), gemms),
        BudgetSection(
            "Speculative decoding (batch 1 and 8)",
            estimate("speculative"),
            speculative,
            requires=(BASE,),
        ),
        BudgetSection(
            "Structured outputs (0 % and 50 % JSON-schema constrained)",
            estimate("structured"),
            structured,
        ),
        BudgetSection(
            "Profile: one decode step and one prefill step",
            estimate("profile"),
            profile,
            requires=(BASE,),
        ),
        BudgetSection(
            "Throughput against transformers (settings swept)",
            estimate("transformers"),
            transformers,
            requires=(BASE,),
        ),
    ]
    if args.skip_tests:
        sections.pop(1)
    state = run_sections(report, sections, float(args.budget_s), out_dir, gr.STARTED)
    report.add(*summary_lines(state, []))
    if report.failed:
        report.add(f"Failed sections: {', '.join(report.failed)}")
    Path(args.out).write_text(report.text())
    (out_dir / "report.md").write_text(report.text())
    print(f"\nwrote {args.out} and {out_dir}/")
    return 1 if report.failed else 0
