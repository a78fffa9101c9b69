"""One call, one markdown report of pagedinfer on a GPU (``make bench-gpu``).

``--budget-s N`` (``make bench-gpu``'s default, ``benchmarks/gpu_session.sh``): the same
sections in another order, most needed on a GPU first, inside ``N`` seconds, each written to
``--out-dir`` as it ends; those that would not fit are skipped and listed
(``benchmarks/_budgeted_report.py``, docs/benchmarks.md "Budgeted GPU run"). Without it,
sections, in the order they run:

1. **Device**: name, versions, the device's copy bandwidth (a large device-to-device
   ``copy_``, bytes read plus written over the time).
2. **GPU tests**: ``pytest -m gpu`` on a fast subset of ``tests/gpu`` (``--all-tests``: all of
   it), in a subprocess with a time limit; pass / fail counts and the failures.
3. **Throughput**: nano-vLLM's workload (256 requests, prompt and output lengths U[100, 1024],
   temperature 0.6, ``ignore_eos``, seed 0) on Qwen3-0.6B's shape with random bf16 weights,
   pagedinfer (triton backend, CUDA graphs), then the profile (4.) on the same engine.
4. **Profile**: ``torch.profiler`` over one decode step (256 sequences, ~1k context, CUDA
   graphs, and again eagerly for the launch count), one mixed step (those decode rows and
   prompts that arrived meanwhile, eager) and one 16k-token prefill step: kernels
   per step, time in attention, GEMMs and the rest, and the decode kernel's achieved
   bandwidth (K/V bytes it must read over its time).
5. **Transformers, settings swept**: what a competent user would set, each on a probe of the
   workload (the same requests, an eighth of the output lengths) in its own process with a
   time limit: ``generate_batch`` (continuous batching) with CUDA graphs and async batching
   at ``max_requests_per_batch`` 256 and 128, with compile level 1, and its defaults; padded
   ``generate`` with a static cache (which transformers compiles). pagedinfer runs the probe
   too. The fastest setting then runs the whole workload, if the budget (``--hf-budget``,
   300 s) allows, else the comparison is on the probe, said so.
6. **HBM bound**: the least time the workload's decode steps can take at the measured copy
   bandwidth, and pagedinfer's fraction of the throughput that bound allows (formula in
   ``docs/benchmarks.md``), counting the bytes a decode step really reads::

       bytes = sum over decode steps of (K/V bytes of every running sequence's context
               + every weight tensor but the input embedding (a tied LM head: that matrix)
               + one input-embedding row per running sequence)
       bound_s = bytes / copy_bandwidth;   bound_tok_s = output_tokens / bound_s

   The copy bandwidth counts bytes read plus bytes written; the bound's traffic is reads.
7. **FP8 KV cache**: the same workload with ``kv_cache_dtype="fp8"`` (e4m3, calibrated
   per-layer scales), its KV capacity against the run above, and its own bound (the same
   formula with one byte per K/V element).
8. **FP8 checkpoint**: the same workload on the same model quantized to block-wise FP8
   (Qwen3-*-FP8's format: e4m3 weights, 128x128 block scales), against its own HBM bound:
   the same formula with the bytes the FP8 checkpoint holds (1-byte weights, float32 scales,
   the bf16 embedding and LM head).
9. **Async scheduling** (one step in flight): the workload, and its first 16 requests (at most
   16 sequences running), with ``async_scheduling`` off and on in alternating rounds, each
   against its own HBM bound.
10. **Structured outputs**: ``benchmarks/structured.py``'s workload (64 requests, 128 tokens,
   its small random model with a tokenizer) with 0 % and 50 % of the requests under a JSON
   schema: throughput, mask time per step, schema compile times.
11. **Decode GEMMs**: Qwen3-0.6B's projections (qkv, o, gate_up, down) and LM head at 1 to
   256 rows in bfloat16, ``F.linear`` (cuBLAS) against the skinny split-K Triton GEMM
   (``adapters/kernels/skinny_gemm.py``) with its planned K split and the best of splits 1,
   2, 4, 8 forced, CUDA events, each call reading its weight from HBM;
   the roofline (the weight's bytes at the copy bandwidth), what the per-shape choice runs,
   and one decode step's GEMM time summed. ``--gemms-only`` runs the device section and this
   one alone (about a minute, estimated). Skipped on the CPU.

Runs from a plain checkout with the Python already on the machine (no install, no network)::

    PYTHONPATH=src python3 benchmarks/gpu_report.py --out gpu-report.md

``--device cpu`` is a smoke run on tiny shapes (the test suite runs it); its numbers mean
nothing. A section that fails is reported in the markdown and the script continues; the exit
status is 1 if any section failed (GPU test failures included).
"""

from __future__ import annotations

import argparse
import inspect
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
STARTED = time.perf_counter()  # before torch's import: --budget-s counts from here

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
    "tests/gpu/test_skinny_gemm_gpu.py",
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
    targets = getattr(args, "test_targets", None) or (
        ["tests/gpu"] if args.all_tests else list(FAST_TESTS)
    )
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
    kv_dtype_bytes: int  # one element of the K/V cache (1 with kv_cache_dtype="fp8")
    step_weight_bytes: int  # weights one decode step reads, the input embedding's rows aside
    embedding_row_bytes: int  # one row of the input embedding (each decoded token reads one)
    checkpoint_bytes: int  # every tensor of the checkpoint once

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes


_DTYPE_BYTES = {
    "F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


def tensor_bytes(model_dir: Path) -> dict[str, tuple[int, list[int]]]:
    """Every tensor of the checkpoint's safetensors files: its bytes and shape (read from the
    files' headers)."""
    found: dict[str, tuple[int, list[int]]] = {}
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
            found[name] = (numel * _DTYPE_BYTES[entry["dtype"]], list(entry["shape"]))
    return found


def checkpoint_bytes(model_dir: Path) -> int:
    """Bytes of every tensor in the checkpoint's safetensors files."""
    return sum(size for size, _ in tensor_bytes(model_dir).values())


def decode_read_bytes(model_dir: Path) -> tuple[int, int]:
    """What a decode step reads of the weights: ``(bytes every step reads, bytes of one input
    embedding row)``. Every tensor is read whole except the input embedding, of which a step
    reads one row per sequence; a tied LM head is that same matrix and reads it whole (an
    untied one is its own tensor, ``lm_head.weight``). Quantized checkpoints count their
    stored bytes (1-byte FP8 weights, their scales)."""
    tensors = tensor_bytes(model_dir)
    embedding = next((n for n in tensors if n.endswith("embed_tokens.weight")), None)
    step = sum(size for name, (size, _) in tensors.items() if name != embedding)
    if embedding is None:
        return step, 0
    size, shape = tensors[embedding]
    if not any(name.endswith("lm_head.weight") for name in tensors):  # tied: the LM head
        step += size
    return step, size // shape[0]


def model_facts(model_dir: Path, kv_dtype: torch.dtype) -> ModelFacts:
    """``kv_dtype``: the K/V cache's element type (the model's, or float8)."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    step, row = decode_read_bytes(model_dir)
    return ModelFacts(
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        kv_dtype_bytes=torch.empty(0, dtype=kv_dtype).element_size(),
        step_weight_bytes=step,
        embedding_row_bytes=row,
        checkpoint_bytes=checkpoint_bytes(model_dir),
    )


def hbm_bound(
    workload: throughput.Workload, facts: ModelFacts, bandwidth: float
) -> dict[str, float]:
    """The decode-only memory-traffic bound of the workload (see the module docstring).

    All requests decode together from the first step (they all fit one batch), so there are
    ``max(output_len) - 1`` decode steps; request ``i`` reads contexts ``p_i + 1`` to
    ``p_i + o_i - 1`` (its first token comes from prefill) and one embedding row per step.
    """
    kv_tokens = decode_tokens = 0
    for prompt, out in zip(workload.prompts, workload.output_lens, strict=True):
        first, last = len(prompt) + 1, len(prompt) + out - 1
        if last >= first:
            kv_tokens += (first + last) * (last - first + 1) // 2
            decode_tokens += last - first + 1
    steps = max(workload.output_lens) - 1
    kv_bytes = kv_tokens * facts.kv_bytes_per_token
    weight_bytes = steps * facts.step_weight_bytes + decode_tokens * facts.embedding_row_bytes
    seconds = (kv_bytes + weight_bytes) / bandwidth
    return {
        "decode_steps": steps,
        "kv_bytes": kv_bytes,
        "weight_bytes": weight_bytes,
        "bound_seconds": seconds,
        "bound_tokens_per_s": workload.output_tokens / seconds,
    }


def bound_lines(
    label: str, result: throughput.Result, bound: dict[str, float], facts: ModelFacts,
    bandwidth: float,
) -> list[str]:  # fmt: skip
    """The bound's arithmetic and the run's share of it, in the report's words."""
    share = result.throughput / bound["bound_tokens_per_s"]
    return [
        f"K/V read by all decode steps: {bound['kv_bytes'] / 1e12:.2f} TB "
        f"({facts.kv_bytes_per_token / 1024:.0f} KiB per token of context); weights "
        f"{facts.step_weight_bytes / 1e9:.2f} GB per step (of {facts.checkpoint_bytes / 1e9:.2f} "
        f"GB in the checkpoint: the input embedding counts one {facts.embedding_row_bytes} B "
        f"row per decoded token) x {bound['decode_steps']:.0f} steps = "
        f"{bound['weight_bytes'] / 1e12:.2f} TB; at {bandwidth / 1e9:.0f} GB/s: "
        f"{bound['bound_seconds']:.2f} s, **{bound['bound_tokens_per_s']:.0f} output tok/s**.",
        "",
        f"{label}: {result.throughput:.0f} output tok/s = **{share:.0%} of the bound**.",
    ]


BANDWIDTH_NOTE = (
    "The bandwidth is a device-to-device copy's bytes read plus bytes written over its time; "
    "the bound's traffic is reads only (K/V, weights), taken at that same rate. A device may "
    "read faster than it copies, so the bound is an estimate, not a ceiling."
)


def engine_for(
    model: str,
    args: argparse.Namespace,
    max_model_len: int,
    kv_cache_dtype: str = "auto",
    async_scheduling: bool = False,
) -> Engine:
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
        kv_cache_dtype=kv_cache_dtype,
        async_scheduling=async_scheduling,
    )


def engine_dtype(engine: Engine) -> torch.dtype:
    """The dtype the engine resolved (``dtype="auto"``)."""
    resolved = getattr(engine, "dtype", None)
    if isinstance(resolved, torch.dtype):
        return resolved
    runner = getattr(engine, "_executor", None)  # internal, as a fallback
    return next(iter(runner.model.parameters())).dtype  # type: ignore[union-attr]


def engine_kv_dtype(engine: Engine) -> torch.dtype:
    """The K/V cache's element type (float8 with ``kv_cache_dtype="fp8"``)."""
    resolved = getattr(engine, "kv_cache_dtype", None)
    return resolved if isinstance(resolved, torch.dtype) else engine_dtype(engine)


def max_len_of(workload: throughput.Workload) -> int:
    return max(len(p) for p in workload.prompts) + max(workload.output_lens) + 1


def run_pagedinfer(
    engine: Engine, workload: throughput.Workload, args: argparse.Namespace, label: str = ""
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
        f"pagedinfer ({engine.attention_backend}, {graphs}{label})", produced, seconds[0]
    )


def versus(result: throughput.Result, dense: throughput.Result | None) -> str:
    if dense is None:
        return ""
    return f" ({result.throughput / dense.throughput:.2f}x the unquantized run above)"


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
    engine = engine_for(str(target), args, max_len_of(workload))
    try:
        facts = model_facts(target, engine_kv_dtype(engine))
        result = run_pagedinfer(engine, workload, args, ", FP8 weights")
    finally:
        engine.close()
        del engine
        throughput.release_memory(str(args.device))
    bound = hbm_bound(workload, facts, bandwidth)
    report.add(
        f"`{target.name}`: e4m3 weights with one float32 scale per {block[0]}x{block[1]} "
        f"block (`quant_method: fp8`), the embedding and norms as they were; "
        f"{'the FP8 GEMM (W8A16)' if cuda else 'dequantized at load (CPU)'}.",
        "",
        f"- {result.name}: **{result.throughput:.0f} output tok/s**{versus(result, dense)}",
        "",
        *bound_lines("pagedinfer (FP8 weights)", result, bound, facts, bandwidth),
    )


def small_batch_of(workload: throughput.Workload, count: int) -> throughput.Workload:
    """The workload's first ``count`` requests: at most ``count`` sequences ever run."""
    return throughput.Workload(
        workload.prompts[:count], workload.output_lens[:count], workload.temperature
    )


def run_async_scheduling(
    report: Report,
    args: argparse.Namespace,
    model: str,
    workload: throughput.Workload,
    bandwidth: float,
    facts: ModelFacts,
) -> None:
    """Sync against async scheduling (one step in flight, issue 24) side by side, on the
    whole workload and on its first 16 requests (the 1-16 running sequences band), each
    against its own HBM bound. Rounds alternate sync and async; the best of each is kept."""
    small = small_batch_of(workload, SMALL_BATCH)
    rows: list[str] = []
    for name, load in (("whole workload", workload), (f"{len(small.prompts)} requests", small)):
        best: dict[bool, throughput.Result] = {}
        for _ in range(args.async_rounds):
            for async_on in (False, True):
                engine = engine_for(model, args, max_len_of(load), async_scheduling=async_on)
                try:
                    label = ", async scheduling" if async_on else ", sync"
                    result = run_pagedinfer(engine, load, args, label)
                finally:
                    engine.close()
                    del engine
                    throughput.release_memory(str(args.device))
                print(f"{name}: {result.name}: {result.throughput:.0f} tok/s", flush=True)
                if async_on not in best or result.seconds < best[async_on].seconds:
                    best[async_on] = result
        bound_tok_s = hbm_bound(load, facts, bandwidth)["bound_tokens_per_s"]
        sync, ahead = best[False], best[True]
        rows.append(
            f"| {name} | {sync.throughput:.0f} ({sync.throughput / bound_tok_s:.0%}) | "
            f"{ahead.throughput:.0f} ({ahead.throughput / bound_tok_s:.0%}) | "
            f"{ahead.throughput / sync.throughput:.2f} | {bound_tok_s:.0f} |"
        )
    report.add(
        f"`Engine(async_scheduling=...)` off and on, best of {args.async_rounds} alternating "
        "rounds each; in parentheses the fraction of the workload's HBM bound (targets: 85 % "
        f"on the whole workload, 65 % with at most {SMALL_BATCH} sequences running).",
        "",
        "| workload | sync tok/s | async tok/s | async / sync | bound tok/s |",
        "|---|---:|---:|---:|---:|",
        *rows,
    )


def run_speculative(report: Report, args: argparse.Namespace, model: str) -> None:
    """Speculative decoding at batch 1 and 8 (issue 26): n-gram, the target as its own draft
    (the upper bound of a draft model) and a smaller random draft, each beside the same
    engine without speculation (``benchmarks/speculative.py``'s workloads and table)."""
    import speculative

    config = json.loads((Path(model) / "config.json").read_text())
    draft = speculative.checkpoint(
        Path(args.cache_dir),
        f"spec-draft-v{config['vocab_size']}",
        1,
        vocab_size=int(config["vocab_size"]),
        **speculative.DRAFT,
    )
    options: dict[str, Any] = {
        "device": str(args.device),
        "kv_block_size": 16,
        "max_model_len": 512,
        "num_kv_blocks": 256,  # several engines at once: a fixed cache each
        "enforce_eager": args.enforce_eager,
    }
    lines = speculative.run(Path(model), draft, options, [3], [1, 8], args.spec_rounds)
    report.add(
        f"`speculative_config` with k = 3 drafts against no speculation, medians of "
        f"{args.spec_rounds} rounds; {speculative.PROMPT_TOKENS}-token random prompts, "
        f"{speculative.OUTPUT_TOKENS} output tokens, greedy; `loop` is plain greedy decoding "
        "(a random model repeats itself: prompt lookup is nearly always right), `no-loop` adds "
        "frequency_penalty=0.5 (every n-gram draft wrong). The acceptance rates are synthetic "
        "(random weights); the draft-model rows are the upper bound (the target as its own "
        "draft) and the lower bound (a 1-layer random draft).",
        "",
        *lines,
    )


def run_fp8_kv(
    report: Report,
    args: argparse.Namespace,
    model: str,
    workload: throughput.Workload,
    bandwidth: float,
    dense: throughput.Result | None,
    dense_blocks: int | None,
) -> None:
    """The workload with ``kv_cache_dtype="fp8"`` (e4m3, calibrated scales), against its own
    HBM bound: the same weights, one byte per K/V element."""
    engine = engine_for(model, args, max_len_of(workload), kv_cache_dtype="fp8")
    try:
        facts = model_facts(Path(model), engine_kv_dtype(engine))
        blocks = engine.stats().num_kv_blocks
        result = run_pagedinfer(engine, workload, args, ", FP8 KV cache")
        line = engine.describe()
    finally:
        engine.close()
        del engine
        throughput.release_memory(str(args.device))
    bound = hbm_bound(workload, facts, bandwidth)
    capacity = f"{blocks} KV blocks of {args.kv_block_size} tokens"
    if dense_blocks:
        capacity += f" ({blocks / dense_blocks:.2f}x the {dense_blocks} of the run above)"
    report.add(
        f'`kv_cache_dtype="fp8"` on the same model: `{line}`; {capacity}.',
        "",
        f"- {result.name}: **{result.throughput:.0f} output tok/s**{versus(result, dense)}",
        "",
        *bound_lines("pagedinfer (FP8 KV cache)", result, bound, facts, bandwidth),
    )


def run_structured_outputs(report: Report, args: argparse.Namespace) -> None:
    """benchmarks/structured.py's workload (issue 23): 0 % and 50 % of the requests under a
    JSON schema, on its own small random model with a tokenizer."""
    import importlib.util

    if importlib.util.find_spec("llguidance") is None:
        report.add("Skipped: the grammar engine is not installed (`pip install llguidance`).")
        return
    import structured  # benchmarks/structured.py
    from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

    cuda = args.device.type == "cuda"
    preset, vocab = ("small", 4096) if cuda else ("tiny", 512)
    batch, max_tokens = (64, 128) if cuda else (4, 6)
    target = Path(args.cache_dir) / f"structured-{preset}-{vocab}"
    if not (target / "config.json").exists():
        build_random_checkpoint(target, preset, with_tokenizer=True, vocab_size=vocab)
    results = structured.run_structured(
        str(target),
        device=str(args.device),
        batch=batch,
        prompt_len=32,
        max_tokens=max_tokens,
        fractions=(0.0, 0.5),
        rounds=2 if cuda else 1,
        engine_kwargs={"max_num_seqs": batch, "attention_backend": args.attention_backend},
    )
    report.add(
        f"`benchmarks/structured.py`'s workload: the `{preset}` random preset (vocabulary "
        f"{vocab}, byte-level BPE), {batch} requests of 32 tokens, {max_tokens} output tokens "
        "each at temperature 0.6; constrained rows under a JSON schema that cannot close "
        "within them (so every row runs to the end); best of "
        f"{2 if cuda else 1} interleaved rounds.",
        "",
        structured.markdown(results),
    )


# -------------------------------------------------------------- transformers, swept
# What a competent user of transformers would set, tried on a probe of the workload (the
# same requests with an eighth of the output lengths), each in its own process with a time
# limit; the fastest then runs the whole workload. Continuous batching on the CPU waits
# ~30 s for its manager to stop, so the CPU smoke run tries padded generate only.
RESULT_MARK = "HF-RESULT "
PROBE_OUTPUT_DIVISOR = 8
SMALL_BATCH = 16  # step_profile's lowest band: 1 to 16 running sequences


@dataclass(frozen=True)
class HFSetting:
    label: str
    api: str  # "generate_batch" (continuous batching) or "generate" (padded batches)
    options: dict[str, Any]


def hf_settings(cuda: bool, num_requests: int) -> list[HFSetting]:
    if not cuda:  # one setting: each costs a process start (torch and transformers import)
        return [
            HFSetting(
                "generate: padded, static cache", "generate", {"batch_size": 0, "static": True}
            )
        ]
    fast = {"use_cuda_graph": True, "use_async_batching": True}
    every = {"max_requests_per_batch": num_requests}
    return [
        HFSetting(
            f"generate_batch: CUDA graphs, async batching, max_requests_per_batch={num_requests}",
            "generate_batch",
            {**fast, **every},
        ),
        HFSetting(
            "generate_batch: CUDA graphs, async batching, max_requests_per_batch=128",
            "generate_batch",
            {**fast, "max_requests_per_batch": 128},
        ),
        HFSetting(
            f"generate_batch: CUDA graphs, async batching, compile level 1, "
            f"max_requests_per_batch={num_requests}",
            "generate_batch",
            {**fast, **every, "default_compile_level": 1},
        ),
        HFSetting("generate_batch: defaults", "generate_batch", {}),
        HFSetting(
            "generate: padded, static cache (transformers' automatic torch.compile), batch 128",
            "generate",
            {"batch_size": 128, "static": True},
        ),
    ]


def probe_of(workload: throughput.Workload) -> throughput.Workload:
    """The workload's requests with an eighth of their output lengths (at least 1)."""
    outputs = [max(1, n // PROBE_OUTPUT_DIVISOR) for n in workload.output_lens]
    return throughput.Workload(workload.prompts, outputs, workload.temperature)


def _cb_config(options: dict[str, Any]) -> tuple[Any, list[str]]:
    """A ContinuousBatchingConfig with the options this transformers knows; the others."""
    import dataclasses

    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:  # older transformers 5.x
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

    known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    unknown = [name for name in options if name not in known]
    kept = {name: value for name, value in options.items() if name in known}
    return ContinuousBatchingConfig(**kept), unknown


def hf_generate_batch(
    model: str, workload: throughput.Workload, args: argparse.Namespace, options: dict[str, Any]
) -> tuple[int, float, list[str]]:
    """Continuous batching (as throughput.run_hf_generate_batch) under ``options``."""
    from transformers import GenerationConfig

    hf_model = throughput._load_hf(model, args, "paged|sdpa")
    config = GenerationConfig(
        do_sample=True,
        temperature=workload.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max(workload.output_lens),
        eos_token_id=-1,
        pad_token_id=0,
    )
    cb_config, unknown = _cb_config(options)
    manager_options: dict[str, Any] = {"block": True, "timeout": 30}
    accepted = inspect.signature(hf_model.continuous_batching_context_manager).parameters
    if "warmup" in accepted:
        manager_options["warmup"] = True
    if "continuous_batching_config" in accepted:
        manager_options["continuous_batching_config"] = cb_config
    elif options:
        raise RuntimeError(
            "this transformers' continuous_batching_context_manager takes no "
            "continuous_batching_config: these settings cannot be applied"
        )
    with (
        hf_model.continuous_batching_context_manager(
            generation_config=config, **manager_options
        ) as manager,
        throughput.timed(args.device) as seconds,
    ):
        produced = throughput.run_continuous_batching(manager, workload)
    return produced, seconds[0], unknown


def hf_generate(
    model: str, workload: throughput.Workload, args: argparse.Namespace, options: dict[str, Any]
) -> tuple[int, float, list[str]]:
    """Padded ``generate``: batches of ``batch_size`` (0: all), each left-padded to the
    workload's longest prompt and run for its longest output, so that every batch has the
    same shapes (one compiled graph with ``static``); an untimed warm-up runs the first
    batch's shapes for a few steps (the static cache is sized by ``max_new_tokens``)."""
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    class StopAfter(StoppingCriteria):  # type: ignore[misc]
        def __init__(self, steps: int) -> None:
            self.steps = steps
            self.calls = 0

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            self.calls += 1
            done = self.calls >= self.steps
            return torch.full(
                (input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device
            )

    hf_model = throughput._load_hf(model, args, "sdpa")
    size = options.get("batch_size") or len(workload.prompts)
    width = max(len(p) for p in workload.prompts)
    pad = 0

    def batch(start: int) -> tuple[torch.Tensor, torch.Tensor]:
        prompts = workload.prompts[start : start + size]
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        return ids.to(args.device), mask.to(args.device)

    def config(new_tokens: int) -> Any:
        extra = {"cache_implementation": "static"} if options.get("static") else {}
        return GenerationConfig(
            do_sample=True,
            temperature=workload.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
            **extra,
        )

    produced = 0
    with torch.inference_mode():
        ids, mask = batch(0)
        hf_model.generate(
            ids,
            attention_mask=mask,
            generation_config=config(max(workload.output_lens)),
            stopping_criteria=StoppingCriteriaList([StopAfter(4)]),
        )
        with throughput.timed(args.device) as seconds:
            for start in range(0, len(workload.prompts), size):
                ids, mask = batch(start)
                hf_model.generate(
                    ids, attention_mask=mask, generation_config=config(max(workload.output_lens))
                )
                produced += sum(workload.output_lens[start : start + size])
    return produced, seconds[0], []


def hf_worker(spec_file: str) -> int:
    """``--hf-run SPEC``: one setting on one workload, its result as one JSON line."""
    spec = json.loads(Path(spec_file).read_text())
    workload = throughput.Workload(spec["prompts"], spec["output_lens"], spec["temperature"])
    args = argparse.Namespace(device=spec["device"], dtype=spec["dtype"])
    run = hf_generate_batch if spec["api"] == "generate_batch" else hf_generate
    produced, seconds, unknown = run(spec["model"], workload, args, spec["options"])
    print(RESULT_MARK + json.dumps({"tokens": produced, "seconds": seconds, "unknown": unknown}))
    return 0


def hf_subprocess(
    setting: HFSetting,
    model: str,
    workload: throughput.Workload,
    args: argparse.Namespace,
    timeout: float,
) -> tuple[throughput.Result | None, str]:
    """Run ``setting`` in a fresh process (its memory, compile caches and CUDA graphs go with
    it); ``(result, note)``, the result ``None`` when it failed or ran past ``timeout``."""
    import tempfile

    spec = {
        "model": model,
        "prompts": workload.prompts,
        "output_lens": workload.output_lens,
        "temperature": workload.temperature,
        "device": str(args.device),
        "dtype": args.dtype,
        "api": setting.api,
        "options": setting.options,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    began = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--hf-run", handle.name],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=max(timeout, 1.0),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"stopped after {timeout:.0f} s (the budget)"
    finally:
        os.unlink(handle.name)
    wall = time.perf_counter() - began
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, f"failed: {tail[:200]}"
    found = json.loads(lines[-1][len(RESULT_MARK) :])
    note = f"{wall:.0f} s with loading and warm-up"
    if found["unknown"]:
        note += f"; not in this transformers: {', '.join(found['unknown'])}"
    return throughput.Result(
        f"transformers {setting.label}", found["tokens"], found["seconds"]
    ), note


def sweep_transformers(
    report: Report,
    args: argparse.Namespace,
    model: str,
    workload: throughput.Workload,
    ours: throughput.Result,
    ours_probe: throughput.Result | None,
) -> None:
    """Every setting on the probe, the fastest on the whole workload, within the budget."""
    began = time.perf_counter()
    budget = float(args.hf_budget)
    probe = probe_of(workload)
    settings = hf_settings(args.device.type == "cuda", len(workload.prompts))
    probes: list[tuple[HFSetting, throughput.Result | None, str]] = []
    for index, setting in enumerate(settings):
        # The probes may spend 70 % of the budget, each at least a minute (loading, warm-up,
        # compiling) if that much is left; the whole-workload run gets the rest.
        left = 0.7 * budget - (time.perf_counter() - began)
        if left <= 5:
            probes.append((setting, None, "skipped: the probes' budget was spent"))
            continue
        share = left / (len(settings) - index)  # what is left, shared by those still to run
        result, note = hf_subprocess(setting, model, probe, args, min(left, max(share, 60.0)))
        probes.append((setting, result, note))
    report.add(
        f"Probe: the same {len(probe.prompts)} requests with an eighth of the output lengths "
        f"({probe.output_tokens} output tokens); each setting in its own process, time-limited "
        f"(budget {budget:.0f} s for the sweep and the final run).",
        "",
        "| system | settings | output tok/s | time (s) | notes |",
        "|---|---|---:|---:|---|",
    )
    if ours_probe is not None:
        report.add(
            f"| pagedinfer | {ours_probe.name} | {ours_probe.throughput:.0f} "
            f"| {ours_probe.seconds:.2f} | in this process |"
        )
    for setting, result, note in probes:
        speed = f"{result.throughput:.0f} | {result.seconds:.2f}" if result else "- | -"
        report.add(f"| transformers | {setting.label} | {speed} | {note} |")
    ran = [(s, r) for s, r, _ in probes if r is not None]
    if not ran:
        raise RuntimeError("no transformers setting finished its probe")
    best_setting, best_probe = max(ran, key=lambda item: item[1].throughput)
    left = budget - (time.perf_counter() - began)
    full, note = hf_subprocess(best_setting, model, workload, args, left)
    rows = [ours]
    if full is not None:
        rows.append(full)
        report.add("", f"Best on the probe: **{best_setting.label}**; on the whole workload:", "")
    else:
        report.add(
            "",
            f"Best on the probe: **{best_setting.label}**; its whole-workload run {note}, so "
            "the comparison below is on the probe.",
            "",
        )
        rows = [r for r in (ours_probe, best_probe) if r is not None]
    base = rows[0].throughput
    report.add(
        "| system | output tokens | time (s) | output tok/s | pagedinfer speed-up |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {r.name} | {r.output_tokens} | {r.seconds:.2f} | {r.throughput:.0f} "
            f"| {base / r.throughput:.2f}x |"
            for r in rows
        ),
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


# ----------------------------------------------------------------------- decode GEMMs
DECODE_GEMMS = "Decode GEMMs: F.linear against the skinny split-K GEMM"
GEMM_ROWS = (1, 16, 64, 128, 256)
GEMM_SPLITS = (1, 2, 4, 8)  # forced K splits, to see which the plan should choose
# Weight copies cycled through per timing, so each call reads its weight from HBM as in a
# decode step (whose weights far exceed the L2 cache), not from L2: several times any GPU's L2.
GEMM_WEIGHT_BYTES = 512 << 20


def decode_gemm_shapes(preset: str = "qwen3-0.6b") -> list[tuple[str, int, int, int]]:
    """``(name, N, K, per step)`` of a decoder layer's projections and the LM head, with how
    many of each one decode step runs, for a random-checkpoint preset (Qwen3-0.6B's shape)."""
    from pagedinfer.adapters.models.random_checkpoint import PRESETS

    spec = PRESETS[preset]
    hidden, heads, kv_heads = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads
    head_dim, intermediate, layers = spec.head_dim, spec.intermediate_size, spec.num_hidden_layers
    return [
        ("qkv", (heads + 2 * kv_heads) * head_dim, hidden, layers),
        ("o", hidden, heads * head_dim, layers),
        ("gate_up", 2 * intermediate, hidden, layers),
        ("down", hidden, intermediate, layers),
        ("lm_head", spec.vocab_size, hidden, 1),
    ]


def cuda_time_us(
    gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    weights: list[torch.Tensor],
    rounds: int = 3,
) -> float:
    """Device microseconds per ``gemm(x, weight)``, CUDA events, best of ``rounds`` passes
    over ``weights`` (copies of one weight, so every call reads its own from HBM)."""
    calls = max(20, len(weights))
    for weight in weights[:3]:
        gemm(x, weight)  # compile and warm up
    best = float("inf")
    for _ in range(rounds):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for call in range(calls):
            gemm(x, weights[call % len(weights)])
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def run_decode_gemms(report: Report, args: argparse.Namespace, bandwidth: float) -> None:
    """F.linear (cuBLAS) against the skinny split-K GEMM at decode shapes, with the roofline
    (the weight's bytes at the copy bandwidth) and what the per-shape choice runs."""
    if args.device.type != "cuda":
        report.add("Skipped: no CUDA device (the skinny GEMM runs on CUDA only).")
        return
    import torch.nn.functional as F

    from pagedinfer.adapters.kernels.skinny_gemm import (
        BLOCK_K,
        prefers_skinny_gemm,
        skinny_gemm,
    )
    from pagedinfer.adapters.kernels.split_k import plan_split_k

    def cublas(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def skinny(split_k: int | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return skinny_gemm(x, weight, split_k=split_k)

        return run

    device, dtype = args.device, torch.bfloat16
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    report.add(
        f"Qwen3-0.6B's decode GEMMs, `y = x W^T` in bfloat16 (random weights), {sms} SMs; "
        "device µs per call (CUDA events, best of 3 passes), each call reading its own copy "
        f"of the weight (at least {GEMM_WEIGHT_BYTES >> 20} MiB of copies, past the L2 "
        "cache). *skinny*: with the split the plan chooses (in brackets); *best split*: the "
        f"fastest of the splits {list(GEMM_SPLITS)} forced. Roofline: the weight's bytes at "
        "the copy bandwidth. *chosen*: what `LinearBase.linear` runs for that shape here.",
        "",
        "| GEMM | N x K | rows | F.linear µs | skinny µs | skinny / F.linear | best split µs "
        "| roofline µs | chosen |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    )
    totals: dict[int, list[float]] = {rows: [0.0, 0.0, 0.0, 0.0] for rows in GEMM_ROWS}
    shapes = decode_gemm_shapes()
    for name, n, k, per_step in shapes:
        weight_bytes = n * k * dtype.itemsize
        copies = max(1, -(-GEMM_WEIGHT_BYTES // weight_bytes))
        generator = torch.Generator(device=device).manual_seed(n + k)
        weights = [
            (torch.randn(n, k, generator=generator, device=device) * k**-0.5).to(dtype)
            for _ in range(copies)
        ]
        roofline_us = weight_bytes / bandwidth * 1e6
        for rows in GEMM_ROWS:
            x = torch.randn(rows, k, generator=generator, device=device).to(dtype)
            cublas_us = cuda_time_us(cublas, x, weights)
            skinny_us = cuda_time_us(skinny(None), x, weights)
            planned = plan_split_k(x, rows, n, k, BLOCK_K, None).splits
            forced = {
                plan_split_k(x, rows, n, k, BLOCK_K, split).splits: cuda_time_us(
                    skinny(split), x, weights
                )
                for split in GEMM_SPLITS
            }
            best = min(forced, key=forced.__getitem__)
            # The LM head is no LinearBase: it always runs F.linear.
            chosen = name != "lm_head" and prefers_skinny_gemm(x, weights[0])
            report.add(
                f"| {name} | {n} x {k} | {rows} | {cublas_us:.1f} | {skinny_us:.1f} ({planned}) "
                f"| {skinny_us / cublas_us:.2f} | {forced[best]:.1f} ({best}) "
                f"| {roofline_us:.1f} | {'skinny' if chosen else 'F.linear'} |"
            )
            total = totals[rows]
            total[0] += per_step * cublas_us
            total[1] += per_step * (skinny_us if chosen else cublas_us)
            total[2] += per_step * min(cublas_us, skinny_us)
            total[3] += per_step * roofline_us
        del weights
        torch.cuda.empty_cache()
    report.add(
        "",
        f"One decode step's GEMMs ({shapes[0][3]} layers of the four projections, the LM head "
        "once), ms:",
        "",
        "| rows | F.linear | as chosen | best of the two per shape | roofline |",
        "|---:|---:|---:|---:|---:|",
        *(
            f"| {rows} | {t[0] / 1e3:.3f} | {t[1] / 1e3:.3f} | {t[2] / 1e3:.3f} "
            f"| {t[3] / 1e3:.3f} |"
            for rows, t in totals.items()
        ),
    )


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
    parser.add_argument(
        "--gemms-only",
        action="store_true",
        help="the device and the decode GEMMs sections alone (no tests, no workload)",
    )
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
        "--baselines",
        default="sweep",
        choices=["sweep", "none"],
        help="sweep transformers' settings (probe, then the best on the whole workload) or none",
    )
    parser.add_argument(
        "--hf-budget",
        type=float,
        default=None,
        help="seconds for the transformers sweep and its final run (default: 300 cuda, 240 cpu)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="run the sections most in need of a GPU first inside this many seconds, each "
        "written to --out-dir as it ends; sections that would not fit are skipped and listed",
    )
    parser.add_argument(
        "--out-dir",
        default=None,
        help="with --budget-s: the folder of the sections' files (default: --out without .md)",
    )
    parser.add_argument("--hf-run", help=argparse.SUPPRESS)  # internal: one transformers setting
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
    parser.add_argument(
        "--async-rounds", type=int, default=2, help="alternating sync/async rounds per workload"
    )
    parser.add_argument(
        "--spec-rounds", type=int, default=2, help="rounds of the speculative decoding section"
    )
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
        "hf_budget": 300 if cuda else 240,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not cuda:
        args.kv_block_size = min(args.kv_block_size, 16)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hf_run:  # internal: one transformers setting, in its own process
        return hf_worker(args.hf_run)
    if args.budget_s is not None:
        from _budgeted_report import budgeted_main  # benchmarks/_budgeted_report.py

        return budgeted_main(args, sys.modules[__name__])
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
    if args.gemms_only:
        with report.section(DECODE_GEMMS):
            run_decode_gemms(report, args, bandwidth)
        return finish(report, args)
    if not args.skip_tests:
        with report.section("GPU tests (fast subset)" if not args.all_tests else "GPU tests (all)"):
            run_gpu_tests(report, args)

    model = ""
    ours: throughput.Result | None = None
    ours_probe: throughput.Result | None = None
    dense_blocks: int | None = None
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
        engine = engine_for(model, args, max(max_len_of(workload), args.profile_context + 64))
        try:
            facts = model_facts(Path(model), engine_kv_dtype(engine))
            dense_blocks = engine.stats().num_kv_blocks
            ours = run_pagedinfer(engine, workload, args)
            report.add(f"- {ours.name}: {ours.throughput:.0f} output tok/s")
            if args.baselines != "none":  # the transformers sweep's probe, for comparison
                ours_probe = run_pagedinfer(engine, probe_of(workload), args)
            with report.section("Profile: one decode step and one prefill step"):
                report.add(*profile_steps(engine, facts, args, bandwidth))
        finally:
            engine.close()
            del engine
            throughput.release_memory(str(args.device))
    with report.section("Throughput against transformers (settings swept)"):
        if ours is None or workload is None:
            raise RuntimeError("needs pagedinfer's throughput")
        if args.baselines == "none":
            report.add("Skipped (`--baselines none`).")
        else:
            sweep_transformers(report, args, model, workload, ours, ours_probe)
    with report.section("HBM bound"):
        if facts is None or workload is None or ours is None or bandwidth <= 0:
            raise RuntimeError("needs the throughput section's results")
        bound = hbm_bound(workload, facts, bandwidth)
        report.add(*bound_lines("pagedinfer", ours, bound, facts, bandwidth), "", BANDWIDTH_NOTE)
    with report.section("FP8 KV cache"):
        if workload is None or facts is None or bandwidth <= 0:
            raise RuntimeError("needs the throughput section's workload")
        run_fp8_kv(report, args, model, workload, bandwidth, ours, dense_blocks)
    with report.section("FP8 checkpoint (block-wise)"):
        if workload is None or bandwidth <= 0:
            raise RuntimeError("needs the throughput section's workload")
        run_fp8_checkpoint(report, args, model, workload, bandwidth, ours)
    with report.section("Async scheduling (one step in flight)"):
        if workload is None or facts is None or bandwidth <= 0:
            raise RuntimeError("needs the throughput section's workload")
        run_async_scheduling(report, args, model, workload, bandwidth, facts)
    with report.section("Structured outputs (0 % and 50 % JSON-schema constrained)"):
        run_structured_outputs(report, args)
    with report.section("Speculative decoding (batch 1 and 8)"):
        run_speculative(report, args, model)
    with report.section(DECODE_GEMMS):
        run_decode_gemms(report, args, bandwidth)
    return finish(report, args)


def finish(report: Report, args: argparse.Namespace) -> int:
    """Write the report; the exit status (1 if a section failed)."""
    report.add("", f"Total time: {time.perf_counter() - report.started:.0f} s.")
    if report.failed:
        report.add(f"Failed sections: {', '.join(report.failed)}")
    Path(args.out).write_text(report.text())
    print(f"\nwrote {args.out}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
