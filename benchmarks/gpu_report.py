"""One call, one markdown report of pagedinfer on a GPU (``make bench-gpu``).

Sections, in the order they run:

1. **Device**: name, versions, the device's copy bandwidth (a large device-to-device
   ``copy_``, bytes read plus written over the time).
2. **GPU tests**: ``pytest -m gpu`` on a fast subset of ``tests/gpu`` (``--all-tests``: all of
   it), in a subprocess with a time limit; pass / fail counts and the failures.
3. **Throughput**: nano-vLLM's workload (256 requests, prompt and output lengths U[100, 1024],
   temperature 0.6, ``ignore_eos``, seed 0) on Qwen3-0.6B's shape with random bf16 weights, for
   pagedinfer (triton backend, CUDA graphs) and transformers' ``generate_batch``, in this
   process, one after the other.
4. **HBM bound**: the least time the workload's decode steps can take at the measured copy
   bandwidth, and pagedinfer's fraction of the throughput that bound allows (formula in
   ``docs/benchmarks.md``)::

       bytes = sum over decode steps of (K/V bytes of every running sequence's context
               + the model's weight bytes)
       bound_s = bytes / copy_bandwidth;   bound_tok_s = output_tokens / bound_s

5. **Profile**: ``torch.profiler`` over one decode step (256 sequences, ~1k context, CUDA
   graphs, and again eagerly for the launch count), one mixed step (those decode rows and
   prompts that arrived meanwhile, eager) and one 16k-token prefill step: kernels
   per step, time in attention, GEMMs and the rest, and the decode kernel's achieved
   bandwidth (K/V bytes it must read over its time).
6. **FP8 checkpoint**: the same workload on the same model quantized to block-wise FP8
   (Qwen3-*-FP8's format: e4m3 weights, 128x128 block scales), against its own HBM bound:
   the same formula with the bytes the FP8 checkpoint holds (1-byte weights, float32 scales,
   the bf16 embedding the tied LM head reads; the K/V cache as before).

Runs from a plain checkout with the Python already on the machine (no install, no network)::

    PYTHONPATH=src python3 benchmarks/gpu_report.py --out gpu-report.md

``--device cpu`` is a smoke run on tiny shapes (the test suite runs it); its numbers mean
nothing. A section that fails is reported in the markdown and the script continues; the exit
status is 1 if any section failed (GPU test failures included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Run from a plain checkout (`python benchmarks/NAME.py` at the repository root, no install):
# this repository's src/ comes first on the import path.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(1, str(REPO / "benchmarks"))  # the sibling throughput.py, however this is run

import torch

import throughput  # the workload and the transformers baseline (benchmarks/throughput.py)
from pagedinfer import Engine, SamplingParams

# The fast subset of the GPU tests: kernels, fused kernels, compile-once, CUDA graphs, the
# one-copy step inputs.
FAST_TESTS = (
    "tests/gpu/test_kernels_gpu.py",
    "tests/gpu/test_fused_kernels_gpu.py",
    "tests/gpu/test_no_recompile_gpu.py",
    "tests/gpu/test_cuda_graph.py",
    "tests/gpu/test_step_inputs_gpu.py",
)


@dataclass
class Report:
    """The markdown being written, and whether any section failed."""

    lines: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)
        for line in lines:
            print(line, flush=True)

    @contextmanager
    def section(self, title: str) -> Iterator[None]:
        self.add("", f"## {title}", "")
        began = time.perf_counter()
        try:
            yield
        except Exception:
            self.failed.append(title)
            self.add("**This section failed:**", "", "```", traceback.format_exc().rstrip(), "```")
        self.add("", f"_({time.perf_counter() - began:.0f} s)_")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


# ---------------------------------------------------------------------------- device
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes per second of a large ``dst.copy_(src)`` (read + write), best of a few runs."""
    numel = megabytes * (1 << 20) // 4
    src = torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        began = time.perf_counter()
        for _ in range(4):
            dst.copy_(src)
        synchronize(device)
        best = min(best, (time.perf_counter() - began) / 4)
    del src, dst
    return 2 * numel * 4 / best


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers", "flash_attn"):
        try:
            found[name] = __import__(name).__version__
        except Exception:
            found[name] = "absent"
    if torch.version.cuda:
        found["cuda"] = torch.version.cuda
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        found["commit"] = commit
    except Exception:
        found["commit"] = "unknown"
    return found


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
        )
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


# ----------------------------------------------------------------------------- tests
def run_gpu_tests(report: Report, args: argparse.Namespace) -> None:
    if args.device.type != "cuda":
        report.add("Skipped: no CUDA device (the CPU smoke run does not run GPU tests).")
        return
    targets = ["tests/gpu"] if args.all_tests else list(FAST_TESTS)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    command += ["-rfE", *targets]
    report.add(f"`{' '.join(command[1:])}` (limit {args.tests_timeout} s)", "")
    try:
        result = subprocess.run(
            command,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.tests_timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as expired:
        report.failed.append("GPU tests (timed out)")
        tail = (expired.stdout or b"")[-3000:]
        report.add("**Timed out.**", "", "```", str(tail), "```")
        return
    lines = result.stdout.strip().splitlines()
    summary = lines[-1] if lines else "(no output)"
    report.add(f"Result: **{summary}**")
    if result.returncode != 0:
        report.failed.append("GPU tests")
        failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        report.add("", "```", *(failures or lines[-40:]), result.stderr[-2000:], "```")


# ------------------------------------------------------------------------ throughput
@dataclass(frozen=True)
class ModelFacts:
    """What the bound and the profile need to know about the checkpoint."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    weight_bytes: int  # every tensor of the checkpoint once (a tied LM head reads the embedding)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


_DTYPE_BYTES = {
    "F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


def checkpoint_bytes(model_dir: Path) -> int:
    """Bytes of every tensor in the checkpoint's safetensors files (read from their headers)."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for size in entry["shape"]:
                numel *= size
            total += numel * _DTYPE_BYTES[entry["dtype"]]
    return total


def model_facts(model_dir: Path, dtype: torch.dtype) -> ModelFacts:
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    return ModelFacts(
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        dtype_bytes=torch.empty(0, dtype=dtype).element_size(),
        weight_bytes=checkpoint_bytes(model_dir),
    )


def hbm_bound(
    workload: throughput.Workload, facts: ModelFacts, bandwidth: float
) -> dict[str, float]:
    """The decode-only memory-traffic bound of the workload (see the module docstring).

    All requests decode together from the first step (they all fit one batch), so there are
    ``max(output_len) - 1`` decode steps; request ``i`` reads contexts ``p_i + 1`` to
    ``p_i + o_i - 1`` (its first token comes from prefill).
    """
    kv_tokens = 0
    for prompt, out in zip(workload.prompts, workload.output_lens, strict=True):
        first, last = len(prompt) + 1, len(prompt) + out - 1
        if last >= first:
            kv_tokens += (first + last) * (last - first + 1) // 2
    steps = max(workload.output_lens) - 1
    kv_bytes = kv_tokens * facts.kv_bytes_per_token
    weight_bytes = steps * facts.weight_bytes
    seconds = (kv_bytes + weight_bytes) / bandwidth
    return {
        "decode_steps": steps,
        "kv_bytes": kv_bytes,
        "weight_bytes": weight_bytes,
        "bound_seconds": seconds,
        "bound_tokens_per_s": workload.output_tokens / seconds,
    }


def engine_for(model: str, args: argparse.Namespace, max_model_len: int) -> Engine:
    return Engine(
        model,
        device=str(args.device),
        dtype=args.dtype,
        max_model_len=max_model_len,
        kv_block_size=args.kv_block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        scheduling_policy=args.scheduling_policy,
    )


def engine_dtype(engine: Engine) -> torch.dtype:
    """The dtype the engine resolved (``dtype="auto"``)."""
    resolved = getattr(engine, "dtype", None)
    if isinstance(resolved, torch.dtype):
        return resolved
    runner = getattr(engine, "_executor", None)  # internal, as a fallback
    return next(iter(runner.model.parameters())).dtype  # type: ignore[union-attr]


def run_pagedinfer(
    engine: Engine, workload: throughput.Workload, args: argparse.Namespace
) -> throughput.Result:
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    params = [
        SamplingParams(temperature=workload.temperature, ignore_eos=True, max_tokens=n)
        for n in workload.output_lens
    ]
    with throughput.timed(str(args.device)) as seconds:
        outputs = engine.generate(workload.prompts, params, use_tqdm=False)
    produced = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    if produced != workload.output_tokens:
        raise RuntimeError(
            f"pagedinfer produced {produced} tokens, expected {workload.output_tokens}"
        )
    graphs = "eager" if args.enforce_eager or args.device.type != "cuda" else "CUDA graphs"
    return throughput.Result(
        f"pagedinfer ({engine.attention_backend}, {graphs})", produced, seconds[0]
    )


def run_fp8_checkpoint(
    report: Report,
    args: argparse.Namespace,
    model: str,
    workload: throughput.Workload,
    bandwidth: float,
    dense: throughput.Result | None,
) -> None:
    """The workload on ``model`` quantized to block-wise FP8, against its own HBM bound."""
    from pagedinfer.adapters.models.quantized_checkpoint import write_quantized_checkpoint

    cuda = args.device.type == "cuda"
    block = (128, 128) if cuda else (32, 32)  # the tiny smoke shapes are not 128-aligned
    target = Path(args.cache_dir) / f"{Path(model).name}-fp8-block{block[0]}"
    if not (target / "config.json").exists():
        print(f"writing a block-wise FP8 copy of {model} in {target} ...")
        write_quantized_checkpoint(model, target, "fp8", block=block)
    max_len = max(len(p) for p in workload.prompts) + max(workload.output_lens) + 1
    engine = engine_for(str(target), args, max_len)
    try:
        facts = model_facts(target, engine_dtype(engine))
        result = run_pagedinfer(engine, workload, args)
    finally:
        engine.close()
        del engine
        throughput.release_memory(str(args.device))
    bound = hbm_bound(workload, facts, bandwidth)
    share = result.throughput / bound["bound_tokens_per_s"]
    report.add(
        f"`{target.name}`: e4m3 weights with one float32 scale per {block[0]}x{block[1]} "
        f"block (`quant_method: fp8`), {facts.weight_bytes / 1e9:.2f} GB of checkpoint read "
        f"per decode step; {'the FP8 GEMM (W8A16)' if cuda else 'dequantized at load (CPU)'}.",
        "",
        f"- {result.name}: **{result.throughput:.0f} output tok/s**"
        + (
            f" ({result.throughput / dense.throughput:.2f}x the unquantized run above)"
            if dense
            else ""
        ),
        f"- HBM bound: K/V {bound['kv_bytes'] / 1e12:.2f} TB + weights "
        f"{bound['weight_bytes'] / 1e12:.2f} TB at {bandwidth / 1e9:.0f} GB/s: "
        f"{bound['bound_tokens_per_s']:.0f} output tok/s; pagedinfer **{share:.0%} of it**.",
    )


# --------------------------------------------------------------------------- profile
ATTENTION_MARKERS = (
    "decode_kernel",
    "prefill_kernel",
    "reduce_splits",
    "store_kv",
    "flash",
    "fmha",
    "attention",
    "sdpa",
)
GEMM_MARKERS = (
    "gemm",
    "nvjet",
    "cutlass",
    "xmma",
    "cublas",
    "matmul",
    "addmm",
    "aten::mm",
    "splitk",
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    if any(marker in lowered for marker in ATTENTION_MARKERS):
        return "attention"
    if any(marker in lowered for marker in GEMM_MARKERS):
        return "GEMM"
    return "rest"


@dataclass(frozen=True)
class StepProfile:
    label: str
    wall_ms: float
    kernels: int
    copies: int  # memcpy / memset operations on the device (host-to-device copies included)
    seconds_by_category: dict[str, float]
    decode_kernel_seconds: float
    decode_kernel_launches: int


def profile_step(engine: Engine, label: str, device: torch.device) -> StepProfile:
    """Profile exactly one ``engine.step()``: device kernels on CUDA, ops on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    synchronize(device)
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        engine.step()
        synchronize(device)
        wall = time.perf_counter() - began
    by_category = {"attention": 0.0, "GEMM": 0.0, "rest": 0.0}
    kernels = copies = 0
    decode_seconds, decode_launches = 0.0, 0
    for event in prof.events():
        if device.type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            seconds = event.device_time_total / 1e6
            if event.name.startswith(("Memcpy", "Memset")):
                copies += 1
                by_category["rest"] += seconds
                continue
        else:  # CPU smoke: leaf ops stand in for kernels
            if event.cpu_children or not event.name.startswith("aten::"):
                continue
            seconds = event.self_cpu_time_total / 1e6
        kernels += 1
        by_category[kernel_category(event.name)] += seconds
        if "_decode_kernel" in event.name:
            decode_seconds += seconds
            decode_launches += 1
    return StepProfile(
        label, wall * 1e3, kernels, copies, by_category, decode_seconds, decode_launches
    )


def step_until(engine: Engine, predicate: Callable[[], bool], limit: int = 10_000) -> None:
    for _ in range(limit):
        if predicate():
            return
        engine.step()
    raise RuntimeError("the engine did not reach the state to profile")


def profile_steps(
    engine: Engine, facts: ModelFacts, args: argparse.Namespace, bandwidth: float
) -> list[str]:
    """Profile a decode step of ``--profile-batch`` sequences, a mixed step (that batch's
    decode rows and prompts that arrived meanwhile) and one full prefill step."""
    batch, context = args.profile_batch, args.profile_context
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1 << 20)
    requests = [
        engine.add_request([(7 * i + j) % 9000 + 1 for j in range(context)], params)
        for i in range(batch)
    ]
    scheduler = engine.scheduler
    step_until(engine, lambda: scheduler.stats().num_waiting == 0)
    decode_steps = scheduler.stats().num_decode_steps
    step_until(engine, lambda: scheduler.stats().num_decode_steps > decode_steps)  # all prefilled
    profiles = [
        profile_step(
            engine, "decode (CUDA graphs)" if args.device.type == "cuda" else "decode", args.device
        )
    ]
    # The same step eagerly, for the launch count (graph replays hide launches from the host).
    runner = getattr(engine, "_executor", None)  # internal: the single-GPU ModelRunner
    graphs = getattr(runner, "graph_runner", None)
    if graphs is not None:
        runner.graph_runner = None  # type: ignore[union-attr]
        try:
            profiles.append(profile_step(engine, "decode (eager)", args.device))
        finally:
            runner.graph_runner = graphs  # type: ignore[union-attr]
    contexts_now = context + 2 + len(profiles)  # tokens each sequence attends to in that step
    prefill_tokens = args.max_num_batched_tokens
    num_prompts = -(-prefill_tokens // context)
    # Prompts arriving while the batch decodes: under the default (mixed) scheduling policy
    # the next step runs the batch's decode rows and prefill chunks in one forward (eagerly).
    mixing = [
        engine.add_request([(13 * i + j) % 9000 + 1 for j in range(context)], params)
        for i in range(num_prompts)
    ]
    mixed_steps = scheduler.stats().num_mixed_steps
    mixed = profile_step(
        engine, f"mixed ({batch} decode rows + prefill, {prefill_tokens}-token budget)", args.device
    )
    if scheduler.stats().num_mixed_steps > mixed_steps:
        profiles.append(mixed)
    for request in requests + mixing:
        engine.abort(request)
    more = [
        engine.add_request([(11 * i + j) % 9000 + 1 for j in range(context)], params)
        for i in range(num_prompts)
    ]
    prefill_steps = scheduler.stats().num_prefill_steps
    prefill = profile_step(engine, f"prefill ({prefill_tokens}-token budget)", args.device)
    if scheduler.stats().num_prefill_steps == prefill_steps:
        prefill = replace(prefill, label="prefill (NOT scheduled: this was another step)")
    profiles.append(prefill)
    for request in more:
        engine.abort(request)
    lines = [
        f"Decode step: {batch} sequences at ~{contexts_now} tokens of context. "
        "Kernel time by category; `kernels` counts device kernels (CPU: leaf ops), `copies` the "
        "device memcpy/memset operations (the step's host-to-device input copy among them).",
        "",
        "| step | wall (ms) | kernels | per layer | copies | attention (ms) | GEMM (ms) "
        "| rest (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in profiles:
        cat = p.seconds_by_category
        lines.append(
            f"| {p.label} | {p.wall_ms:.2f} | {p.kernels} | {p.kernels / facts.num_layers:.1f} "
            f"| {p.copies} "
            f"| {cat.get('attention', 0) * 1e3:.2f} | {cat.get('GEMM', 0) * 1e3:.2f} "
            f"| {cat.get('rest', 0) * 1e3:.2f} |"
        )
    decode = profiles[0]
    if decode.decode_kernel_launches:
        per_launch = decode.decode_kernel_seconds / decode.decode_kernel_launches
        kv_bytes = batch * contexts_now * facts.kv_bytes_per_token / facts.num_layers
        achieved = kv_bytes / per_launch
        lines += [
            "",
            f"Decode attention kernel: {decode.decode_kernel_launches} launches, "
            f"{per_launch * 1e6:.1f} µs each, reading {kv_bytes / 2**20:.1f} MiB of K/V per "
            f"layer: **{achieved / 1e9:.0f} GB/s, {achieved / bandwidth:.0%} of copy bandwidth**.",
        ]
    else:
        lines += ["", "Decode attention kernel: not seen in the profile (not the triton backend?)."]
    return lines


# ------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", default="gpu-report.md", help="markdown report to write")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--all-tests", action="store_true", help="run every GPU test, not the fast subset"
    )
    parser.add_argument("--skip-tests", action="store_true", help="no GPU tests")
    parser.add_argument("--tests-timeout", type=int, default=240, help="seconds for the GPU tests")
    parser.add_argument("--model", help="local checkpoint (default: random weights)")
    parser.add_argument(
        "--random-weights", default=None, help="preset: qwen3-0.6b (cuda), tiny (cpu)"
    )
    parser.add_argument("--cache-dir", default=".bench-cache")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--attention-backend", default=None, help="default: triton on cuda, torch on cpu"
    )
    parser.add_argument(
        "--baselines", default="generate_batch", help="generate_batch, generate or none"
    )
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--input-len", type=int, nargs=2, default=None)
    parser.add_argument("--output-len", type=int, nargs=2, default=None)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-block-size", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--scheduling-policy", default="mixed", choices=["mixed", "prefill_first"])
    parser.add_argument("--profile-batch", type=int, default=None, help="decode batch to profile")
    parser.add_argument("--profile-context", type=int, default=None, help="its prompt length")
    parser.add_argument("--bandwidth-mb", type=int, default=None, help="copy-bandwidth buffer size")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    cuda = args.device.type == "cuda"
    scale = throughput.SCALES["full" if cuda else "smoke"]
    defaults: dict[str, Any] = {
        "random_weights": "qwen3-0.6b" if cuda else "tiny",
        "attention_backend": "triton" if cuda else "torch",
        "num_requests": scale["num_requests"],
        "input_len": scale["input_len"],
        "output_len": scale["output_len"],
        "max_num_batched_tokens": 16384 if cuda else 256,
        "profile_batch": 256 if cuda else 4,
        "profile_context": 1000 if cuda else 24,
        "bandwidth_mb": 2048 if cuda else 64,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not cuda:
        args.kv_block_size = min(args.kv_block_size, 16)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report()
    report.add("# pagedinfer GPU report", "")
    bandwidth = 0.0
    with report.section("Device"):
        found = versions()
        report.add(f"- device: **{describe_device(args.device)}**")
        report.add(*(f"- {name}: {value}" for name, value in found.items()))
        bandwidth = copy_bandwidth(args.device, args.bandwidth_mb)
        report.add(
            f"- copy bandwidth (device to device, read + write): **{bandwidth / 1e9:.0f} GB/s**"
        )
    if not args.skip_tests:
        with report.section("GPU tests (fast subset)" if not args.all_tests else "GPU tests (all)"):
            run_gpu_tests(report, args)

    model = ""
    results: list[throughput.Result] = []
    facts: ModelFacts | None = None
    workload: throughput.Workload | None = None
    with report.section("Throughput: nano-vLLM's workload"):
        model = throughput.resolve_model(args)
        config = json.loads((Path(model) / "config.json").read_text())
        workload = throughput.make_workload(args, int(config["vocab_size"]))
        report.add(
            f"Model: `{args.model or args.random_weights}`; {len(workload.prompts)} requests, "
            f"prompts U{list(args.input_len)}, outputs U{list(args.output_len)} "
            f"({workload.output_tokens} output tokens), temperature {args.temperature}, "
            f"ignore_eos, seed {args.seed}; block size {args.kv_block_size}, max_num_seqs "
            f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
            f"scheduling policy {args.scheduling_policy}. "
            "Every system runs once, in this process, one after the other.",
            "",
        )
        max_len = max(len(p) for p in workload.prompts) + max(workload.output_lens) + 1
        engine = engine_for(model, args, max(max_len, args.profile_context + 64))
        try:
            facts = model_facts(Path(model), engine_dtype(engine))
            results.append(run_pagedinfer(engine, workload, args))
            report.add(f"- {results[-1].name}: {results[-1].throughput:.0f} output tok/s")
            with report.section("Profile: one decode step and one prefill step"):
                report.add(*profile_steps(engine, facts, args, bandwidth))
        finally:
            engine.close()
            del engine
            throughput.release_memory(str(args.device))
    with report.section("Throughput against transformers"):
        if not results or workload is None:
            raise RuntimeError("needs pagedinfer's throughput")
        baseline_args = argparse.Namespace(
            **{**vars(args), "device": str(args.device), "hf_batch_size": 0}
        )
        for name in [] if args.baselines == "none" else args.baselines.split(","):
            results.append(throughput.BASELINES[name](model, workload, baseline_args))
        ours = results[0].throughput
        report.add(
            "| system | output tokens | time (s) | output tok/s | pagedinfer speed-up |",
            "|---|---:|---:|---:|---:|",
            *(
                f"| {r.name} | {r.output_tokens} | {r.seconds:.2f} | {r.throughput:.0f} "
                f"| {ours / r.throughput:.2f}x |"
                for r in results
            ),
        )
    with report.section("HBM bound"):
        if facts is None or workload is None or not results or bandwidth <= 0:
            raise RuntimeError("needs the throughput section's results")
        bound = hbm_bound(workload, facts, bandwidth)
        ours = results[0].throughput
        report.add(
            f"K/V read by all decode steps: {bound['kv_bytes'] / 1e12:.2f} TB "
            f"({facts.kv_bytes_per_token / 1024:.0f} KiB per token of context); weights "
            f"{facts.weight_bytes / 1e9:.2f} GB per step x {bound['decode_steps']:.0f} steps = "
            f"{bound['weight_bytes'] / 1e12:.2f} TB; at {bandwidth / 1e9:.0f} GB/s: "
            f"{bound['bound_seconds']:.2f} s, **{bound['bound_tokens_per_s']:.0f} output tok/s**.",
            "",
            f"pagedinfer: {ours:.0f} output tok/s = "
            f"**{ours / bound['bound_tokens_per_s']:.0%} of the bound**.",
        )
    with report.section("FP8 checkpoint (block-wise)"):
        if workload is None or bandwidth <= 0:
            raise RuntimeError("needs the throughput section's workload")
        dense = results[0] if results else None
        run_fp8_checkpoint(report, args, model, workload, bandwidth, dense)
    report.add("", f"Total time: {time.perf_counter() - report.started:.0f} s.")
    if report.failed:
        report.add(f"Failed sections: {', '.join(report.failed)}")
    Path(args.out).write_text(report.text())
    print(f"\nwrote {args.out}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
