"""Where the time of the GPU report's workload goes: host phases against device time.

``benchmarks/gpu_report.py`` says how fast pagedinfer runs nano-vLLM's workload and how far
that is from the HBM bound; this script says why, in one process:

1. **Timed run**: the workload once, uninstrumented but for a timer per step (output tok/s,
   as in the report), then a second time: the slowest steps of each, and the Triton kernel
   variants compiled during each run (a compile mid-run costs ~1 s of wall time).
2. **Phases**: the workload again with wall-clock timers around each part of a step:
   scheduling, packing the inputs, launching the model, launching the sampler, waiting for the
   sampled ids (the step's one device-to-host wait: device time the host did not hide), and
   the engine's bookkeeping (postprocess, outputs). ``wait`` large: the device is the limit;
   small: the host is.
3. **Host profile** (``--cprofile``): cProfile over a third run, the top functions by own time.
4. **Device timeline**: ``torch.profiler`` over a few steady decode steps of the report's
   profile batch: device kernel time against wall time per step (the idle share is host time
   the device waited for).

Runs from a plain checkout, like the report::

    PYTHONPATH=src python3 benchmarks/step_profile.py --cprofile

``--device cpu`` is a smoke run on tiny shapes; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(1, str(REPO / "benchmarks"))

import torch

import gpu_report
import throughput
from pagedinfer import Engine, SamplingParams


class PhaseTimers:
    """Wall-clock seconds and calls per phase, from wrappers around bound methods."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._wrapped: list[tuple[Any, str, bool, Any]] = []

    def wrap(self, owner: Any, attribute: str, phase: str) -> None:
        original: Callable[..., Any] = getattr(owner, attribute)
        own = attribute in vars(owner)  # an instance attribute (else the class's method)
        self._wrapped.append((owner, attribute, own, vars(owner).get(attribute)))

        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - began
                self.calls[phase] = self.calls.get(phase, 0) + 1

        setattr(owner, attribute, timed)

    def unwrap(self) -> None:
        for owner, attribute, own, original in reversed(self._wrapped):
            if own:
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)
        self._wrapped.clear()


def compiled_kernels() -> dict[str, set[str]]:
    """Specialization keys of every compiled variant of pagedinfer's Triton kernels (empty
    where Triton or its cache internals are absent)."""
    import importlib
    import pkgutil

    try:
        import triton.runtime.jit as jit

        import pagedinfer.adapters.kernels as package
    except Exception:
        return {}
    found: dict[str, set[str]] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, value in vars(module).items():
            caches = getattr(value, "device_caches", None)
            if not isinstance(value, jit.JITFunction) or caches is None:
                continue
            keys = {str(key) for entry in caches.values() for key in entry[0]}
            found[f"{info.name}.{name}"] = keys
    return found


def new_compiles(before: dict[str, set[str]], after: dict[str, set[str]]) -> list[str]:
    lines = []
    for name, keys in sorted(after.items()):
        for key in sorted(keys - before.get(name, set())):
            lines.append(f"- `{name}`: {key[:300]}")
    return lines or ["- none"]


class StepLog:
    """Each step's shape and times, from a wrapper around ``Engine._execute``: ``execute``
    is the runner's part (packing, launches, the wait for the sampled ids), ``cycle`` the time
    from this step's start to the next one's (everything the engine does per step)."""

    def __init__(self, engine: Engine) -> None:
        # (kind, sequences, tokens, summed context lengths, execute s, start s)
        self.rows: list[tuple[str, int, int, int, float, float]] = []
        self._engine = engine
        original = engine._execute

        def timed(plan: Any) -> Any:
            began = time.perf_counter()
            result = original(plan)
            kind = "mixed" if plan.is_mixed else "prefill" if plan.is_prefill else "decode"
            contexts = sum(plan.context_lens)
            seconds = time.perf_counter() - began
            self.rows.append((kind, plan.num_seqs, plan.num_tokens, contexts, seconds, began))
            return result

        engine._execute = timed  # type: ignore[method-assign]
        self.ended = 0.0

    def close(self) -> None:
        vars(self._engine).pop("_execute", None)
        self.ended = time.perf_counter()

    def cycles(self) -> list[float]:
        starts = [row[5] for row in self.rows] + [self.ended]
        return [later - earlier for earlier, later in itertools.pairwise(starts)]

    def decode_efficiency(self, facts: gpu_report.ModelFacts, bandwidth: float) -> list[str]:
        """Decode steps by batch size: their time against their own HBM bound (each step's
        K/V plus the weights a decode step reads, at the copy bandwidth: every tensor once
        but the input embedding, one row per sequence; ``gpu_report.decode_read_bytes``)."""
        bands = [(1, 16), (17, 64), (65, 128), (129, 192), (193, 256), (257, 1 << 30)]
        lines = [
            "| decode batch | steps | cycle (s) | execute (s) | bound (s) | bound / cycle |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        cycles = self.cycles()
        for low, high in bands:
            picked = [
                (row, cycle)
                for row, cycle in zip(self.rows, cycles, strict=True)
                if row[0] == "decode" and low <= row[1] <= high
            ]
            if not picked:
                continue
            cycle = sum(c for _, c in picked)
            execute = sum(row[4] for row, _ in picked)
            kv = sum(row[3] for row, _ in picked) * facts.kv_bytes_per_token
            weights = len(picked) * facts.step_weight_bytes
            weights += sum(row[1] for row, _ in picked) * facts.embedding_row_bytes
            bound = (kv + weights) / bandwidth
            lines.append(
                f"| {low}-{min(high, 99999)} | {len(picked)} | {cycle:.2f} | {execute:.2f} "
                f"| {bound:.2f} | {bound / cycle:.0%} |"
            )
        return lines

    def slowest(self, count: int) -> list[str]:
        order = sorted(range(len(self.rows)), key=lambda i: -self.rows[i][4])[:count]
        return [
            f"| {i} | {self.rows[i][0]} | {self.rows[i][1]} | {self.rows[i][2]} "
            f"| {self.rows[i][4] * 1e3:.1f} |"
            for i in order
        ]

    def totals(self) -> str:
        by_kind: dict[str, tuple[int, float]] = {}
        for kind, _, _, _, seconds, _ in self.rows:
            steps, total = by_kind.get(kind, (0, 0.0))
            by_kind[kind] = (steps + 1, total + seconds)
        return ", ".join(f"{k}: {n} steps {t:.2f} s" for k, (n, t) in sorted(by_kind.items()))


def logged_run(
    engine: Engine,
    workload: throughput.Workload,
    label: str,
    facts: gpu_report.ModelFacts,
    bandwidth: float,
) -> list[str]:
    before = compiled_kernels()
    log = StepLog(engine)
    try:
        wall, produced = run_workload(engine, workload)
    finally:
        log.close()
    return [
        f"{label}: {produced} output tokens in {wall:.2f} s: "
        f"**{produced / wall:.0f} output tok/s**; execute time by step kind: {log.totals()}.",
        "",
        "Slowest steps:",
        "",
        "| step | kind | sequences | tokens | execute (ms) |",
        "|---:|---|---:|---:|---:|",
        *log.slowest(8),
        "",
        "Triton kernel variants compiled during this run:",
        "",
        *new_compiles(before, compiled_kernels()),
        "",
        "Decode steps against their own bound (K/V of the step's contexts plus the weights a "
        "decode step reads: every tensor but the input embedding, of which one row per "
        f"sequence; at {bandwidth / 1e9:.0f} GB/s, a copy's read + write rate, while this "
        "traffic is reads):",
        "",
        *log.decode_efficiency(facts, bandwidth),
        "",
    ]


def run_workload(engine: Engine, workload: throughput.Workload) -> tuple[float, int]:
    params = [
        SamplingParams(temperature=workload.temperature, ignore_eos=True, max_tokens=n)
        for n in workload.output_lens
    ]
    engine.reset_prefix_cache()  # every run prefills its prompts, as the first one does
    gpu_report.synchronize(torch.device(engine.device))
    began = time.perf_counter()
    outputs = engine.generate(workload.prompts, params, use_tqdm=False)
    gpu_report.synchronize(torch.device(engine.device))
    produced = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return time.perf_counter() - began, produced


def phase_table(engine: Engine, workload: throughput.Workload) -> list[str]:
    timers = PhaseTimers()
    runner: Any = engine._executor  # internal: the single-GPU ModelRunner
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(runner, "prepare", "pack inputs")
    timers.wrap(runner, "_run_model", "launch model")
    timers.wrap(runner.sampling, "sampler", "launch sampler")
    timers.wrap(runner, "_sample", "sample (launch + wait)")
    timers.wrap(engine, "_execute", "execute (all of the runner)")
    timers.wrap(engine, "_record", "bookkeeping")
    try:
        wall, _ = run_workload(engine, workload)
    finally:
        timers.unwrap()
    seconds = timers.seconds
    waited = seconds.get("sample (launch + wait)", 0.0) - seconds.get("launch sampler", 0.0)
    steps = timers.calls.get("execute (all of the runner)", 0)
    rows = [
        ("schedule", seconds.get("schedule", 0.0)),
        ("pack inputs", seconds.get("pack inputs", 0.0)),
        ("launch model", seconds.get("launch model", 0.0)),
        ("launch sampler", seconds.get("launch sampler", 0.0)),
        ("wait for sampled ids (+ logprobs)", waited),
        ("execute, all of it", seconds.get("execute (all of the runner)", 0.0)),
        ("bookkeeping (postprocess, outputs)", seconds.get("bookkeeping", 0.0)),
    ]
    lines = [
        f"Instrumented run: {wall:.2f} s wall, {steps} steps.",
        "",
        "| phase | total (s) | per step (ms) | share of wall |",
        "|---|---:|---:|---:|",
    ]
    for name, total in rows:
        lines.append(
            f"| {name} | {total:.3f} | {total / max(steps, 1) * 1e3:.3f} | {total / wall:.0%} |"
        )
    return lines


def host_profile(engine: Engine, workload: throughput.Workload, top: int) -> list[str]:
    profiler = cProfile.Profile()
    profiler.enable()
    run_workload(engine, workload)
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    return ["```", stream.getvalue().strip(), "```"]


def device_timeline(engine: Engine, args: argparse.Namespace, num_steps: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(engine.device)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1 << 20)
    requests = [
        engine.add_request([(7 * i + j) % 9000 + 1 for j in range(args.profile_context)], params)
        for i in range(args.profile_batch)
    ]
    stats = engine.scheduler.stats
    gpu_report.step_until(engine, lambda: stats().num_waiting == 0)
    decoded = stats().num_decode_steps
    gpu_report.step_until(engine, lambda: stats().num_decode_steps > decoded + 2)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    gpu_report.synchronize(device)
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        gpu_report.synchronize(device)
        wall = time.perf_counter() - began
    for request in requests:
        engine.abort(request)
    kernel_seconds = 0.0
    for event in prof.events():
        if device.type == "cuda" and event.device_type == torch.autograd.DeviceType.CUDA:
            kernel_seconds += event.device_time_total / 1e6
    per_step = wall / num_steps
    lines = [
        f"{num_steps} decode steps of {args.profile_batch} sequences at ~{args.profile_context} "
        f"tokens (profiler on): {per_step * 1e3:.2f} ms wall per step, "
        f"{kernel_seconds / num_steps * 1e3:.2f} ms of device kernels and copies per step: "
        f"**device busy {kernel_seconds / wall:.0%}**.",
        "",
        "Host operators by own CPU time (all steps):",
        "",
        "```",
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20),
        "```",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cprofile", action="store_true", help="also a cProfile run")
    parser.add_argument("--top", type=int, default=35, help="functions in the host profile")
    parser.add_argument("--timeline-steps", type=int, default=10)
    parser.add_argument("--out", default=None, help="also write the markdown here")
    ours, rest = parser.parse_known_args(argv)
    args = gpu_report.parse_args(rest)
    model = throughput.resolve_model(args)
    config = json.loads((Path(model) / "config.json").read_text())
    workload = throughput.make_workload(args, int(config["vocab_size"]))
    max_len = max(len(p) for p in workload.prompts) + max(workload.output_lens) + 1
    engine = gpu_report.engine_for(model, args, max(max_len, args.profile_context + 64))
    lines: list[str] = [f"# Step profile on {gpu_report.describe_device(args.device)}", ""]

    def add(*more: str) -> None:
        lines.extend(more)
        print("\n".join(more), flush=True)

    try:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        bandwidth = gpu_report.copy_bandwidth(torch.device(engine.device), args.bandwidth_mb)
        facts = gpu_report.model_facts(Path(model), gpu_report.engine_dtype(engine))
        add(*logged_run(engine, workload, "First timed run", facts, bandwidth))
        add(*logged_run(engine, workload, "Second timed run", facts, bandwidth))
        add(*phase_table(engine, workload), "")
        if ours.cprofile:
            add("Host profile (cProfile, own time):", "", *host_profile(engine, workload, ours.top))
            add("")
        add(*device_timeline(engine, args, ours.timeline_steps))
    finally:
        engine.close()
    if ours.out:
        Path(ours.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
