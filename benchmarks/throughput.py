"""Offline throughput: pagedinfer vs Hugging Face transformers on nano-vLLM's workload.

nano-vLLM's benchmark: 256 requests, prompt lengths U[100, 1024], output lengths U[100, 1024],
random token ids < 10000, temperature 0.6, ignore_eos, seed 0. Throughput = output tokens /
wall time including prefill. The baselines run on the same workload, in the same process:

* ``generate``: transformers' padded ``model.generate`` over batches of requests (each batch
  generates its longest output; only the requested tokens are counted),
* ``generate_batch``: transformers' continuous batching (``attn_implementation="paged|sdpa"``),
  one request per prompt with its own ``max_new_tokens``.

With ``--repeats N`` every system runs N times, round-robin (ours, baselines, ours, ...), each
time from a freshly built engine or model (no prefix cache carried over), and the table shows
the median run and the range; short CPU runs vary by 10-20 % from run to run. The table also
gives each run's CPU time (``time.process_time``, all threads of this process), which other
processes on a shared machine disturb less than wall time.

``--scheduling-policy both`` runs pagedinfer under both policies (``mixed``, the default, and
``prefill_first``) side by side, alternating with the baselines.

Examples::

    python benchmarks/throughput.py --device cpu --scale cpu            # CPU: small model
    python benchmarks/throughput.py --device cuda --random-weights qwen3-0.6b   # nano-vLLM setup
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Run from a plain checkout (`python benchmarks/NAME.py` at the repository root, no install):
# this repository's src/ comes first on the import path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

SCALES: dict[str, dict[str, Any]] = {
    # nano-vLLM's workload and engine settings.
    "full": {
        "num_requests": 256,
        "input_len": (100, 1024),
        "output_len": (100, 1024),
        "max_num_batched_tokens": 16384,
    },
    # The CPU target of the CPU model-path issue: 2 threads, small Qwen3. A 4096-token step
    # budget keeps activations to a few MB; with 16384 the one prefill step allocates ~50 MB
    # tensors, which glibc maps fresh (page faults) whenever its heap was disturbed, e.g. by
    # the baseline that ran before: 6 % slower median and slow outliers (docs/benchmarks.md).
    "cpu": {
        "num_requests": 64,
        "input_len": (16, 256),
        "output_len": (16, 128),
        "max_num_batched_tokens": 4096,
    },
    # A smoke run (tests, quick checks).
    "smoke": {
        "num_requests": 6,
        "input_len": (4, 24),
        "output_len": (2, 8),
        "max_num_batched_tokens": 16384,
    },
}


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class Result:
    name: str
    output_tokens: int
    seconds: float
    cpu_seconds: float = float("nan")  # CPU time of this process (all threads)

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.seconds


@dataclass(frozen=True)
class Summary:
    """All runs of one system: the median decides the table, the range shows the noise."""

    name: str
    runs: list[Result]

    @property
    def median_throughput(self) -> float:
        return statistics.median(r.throughput for r in self.runs)

    @property
    def median_seconds(self) -> float:
        return statistics.median(r.seconds for r in self.runs)

    @property
    def median_cpu_seconds(self) -> float:
        return statistics.median(r.cpu_seconds for r in self.runs)

    @property
    def throughput_range(self) -> tuple[float, float]:
        values = [r.throughput for r in self.runs]
        return min(values), max(values)


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    id_limit = min(10000, vocab_size - 1)
    prompts = [
        [rng.randint(0, id_limit) for _ in range(rng.randint(*args.input_len))]
        for _ in range(args.num_requests)
    ]
    output_lens = [rng.randint(*args.output_len) for _ in range(args.num_requests)]
    return Workload(prompts, output_lens, args.temperature)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed(device: str) -> Iterator[list[float]]:
    """``box[0]``: wall seconds of the block; ``box[1]``: CPU seconds of this process."""
    box: list[float] = []
    synchronize(device)
    started, started_cpu = time.perf_counter(), time.process_time()
    yield box
    synchronize(device)
    box.append(time.perf_counter() - started)
    box.append(time.process_time() - started_cpu)


def release_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- pagedinfer
def run_pagedinfer(
    model: str, workload: Workload, args: argparse.Namespace, policy: str = "mixed"
) -> Result:
    max_len = max(len(p) for p in workload.prompts) + max(workload.output_lens) + 1
    engine = Engine(
        model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=max(max_len, args.max_model_len),
        kv_block_size=args.kv_block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        scheduling_policy=policy,
    )
    try:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        params = [
            SamplingParams(temperature=workload.temperature, ignore_eos=True, max_tokens=n)
            for n in workload.output_lens
        ]
        with timed(args.device) as seconds:
            outputs = engine.generate(workload.prompts, params, use_tqdm=args.progress)
        produced = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        if produced != workload.output_tokens:
            raise RuntimeError(
                f"pagedinfer produced {produced} tokens, expected {workload.output_tokens}"
            )
        name = f"pagedinfer ({engine.attention_backend}"
        name += ", eager" if args.enforce_eager or engine.device.type == "cpu" else ", CUDA graphs"
        name += ")" if args.scheduling_policy != "both" else f", {policy})"
    finally:
        engine.close()
        del engine
        release_memory(args.device)
    return Result(name, produced, seconds[0], seconds[1])


# --------------------------------------------------------------------------- transformers
def _load_hf(model: str, args: argparse.Namespace, attn: str | None) -> Any:
    from transformers import AutoModelForCausalLM

    dtype = {
        "auto": "auto",
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
    }[args.dtype]
    if dtype == "auto" and not args.device.startswith("cuda"):
        dtype = torch.float32
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn is not None:
        kwargs["attn_implementation"] = attn
    hf_model = AutoModelForCausalLM.from_pretrained(model, **kwargs).to(args.device)
    hf_model.eval()
    return hf_model


def run_hf_generate(model: str, workload: Workload, args: argparse.Namespace) -> Result:
    """Padded ``generate``: left-padded batches; each batch runs to its longest output."""
    from transformers import GenerationConfig

    hf_model = _load_hf(model, args, "sdpa")
    batch_size = args.hf_batch_size or len(workload.prompts)
    pad = 0
    try:
        # Warm-up on a tiny batch.
        hf_model.generate(
            torch.tensor([[1, 2, 3]], device=args.device),
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=pad,
        )
        with timed(args.device) as seconds, torch.inference_mode():
            for start in range(0, len(workload.prompts), batch_size):
                prompts = workload.prompts[start : start + batch_size]
                longest_out = max(workload.output_lens[start : start + batch_size])
                width = max(len(p) for p in prompts)
                ids = torch.full((len(prompts), width), pad, dtype=torch.long)
                mask = torch.zeros((len(prompts), width), dtype=torch.long)
                for row, prompt in enumerate(prompts):
                    ids[row, width - len(prompt) :] = torch.tensor(prompt)
                    mask[row, width - len(prompt) :] = 1
                config = GenerationConfig(
                    do_sample=True,
                    temperature=workload.temperature,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=longest_out,
                    min_new_tokens=longest_out,
                    pad_token_id=pad,
                )
                hf_model.generate(
                    ids.to(args.device),
                    attention_mask=mask.to(args.device),
                    generation_config=config,
                )
    finally:
        del hf_model
        release_memory(args.device)
    return Result(
        f"transformers generate (padded, batch {batch_size})",
        workload.output_tokens,
        seconds[0],
        seconds[1],
    )


def run_continuous_batching(manager: Any, workload: Workload) -> int:
    """Every request of ``workload`` through transformers' continuous-batching ``manager``,
    waiting until each has finished; the tokens they generated."""
    for index, (prompt, max_new) in enumerate(
        zip(workload.prompts, workload.output_lens, strict=True)
    ):
        manager.add_request(input_ids=prompt, request_id=f"r{index}", max_new_tokens=max_new)
    finished: dict[str, int] = {}
    while len(finished) < len(workload.prompts):
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching manager stopped")
            continue
        if result.is_finished():
            finished[result.request_id] = len(result.generated_tokens)
    return sum(finished.values())


def run_hf_generate_batch(model: str, workload: Workload, args: argparse.Namespace) -> Result:
    """Continuous batching: one request per prompt with its own ``max_new_tokens``."""
    from transformers import GenerationConfig

    hf_model = _load_hf(model, args, "paged|sdpa")
    config = GenerationConfig(
        do_sample=True,
        temperature=workload.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max(workload.output_lens),
        eos_token_id=-1,
        pad_token_id=0,
    )
    try:
        # The manager warms up (and on CUDA captures its graphs) when the context opens, and
        # joins its thread when it closes: neither is timed, as pagedinfer's engine
        # construction and close are not.
        with (
            hf_model.continuous_batching_context_manager(
                generation_config=config, block=True, timeout=30, warmup=True
            ) as manager,
            timed(args.device) as seconds,
        ):
            produced = run_continuous_batching(manager, workload)
    finally:
        del hf_model
        release_memory(args.device)
    return Result("transformers generate_batch (paged, sdpa)", produced, seconds[0], seconds[1])


BASELINES: dict[str, Callable[[str, Workload, argparse.Namespace], Result]] = {
    "generate": run_hf_generate,
    "generate_batch": run_hf_generate_batch,
}


# ------------------------------------------------------------------------------- driver
def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    directory = Path(args.cache_dir) / args.random_weights
    if not (directory / "config.json").exists():
        print(f"building a random-weight {args.random_weights} checkpoint in {directory} ...")
        build_random_checkpoint(directory, args.random_weights, seed=0)
    return str(directory)


def describe_device(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", help="local checkpoint directory")
    parser.add_argument(
        "--random-weights",
        default=None,
        help="preset for a random checkpoint: tiny, small, qwen3-0.6b",
    )
    parser.add_argument("--cache-dir", default=".bench-cache", help="where random checkpoints go")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--scale",
        choices=sorted(SCALES),
        default=None,
        help="workload size (default: full on CUDA, cpu on the CPU)",
    )
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per system, round-robin; the table shows the median (default: 3 at the "
        "cpu and smoke scales, 1 at full scale)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--baselines",
        default="generate,generate_batch",
        help="comma-separated: generate, generate_batch (or 'none')",
    )
    parser.add_argument("--hf-batch-size", type=int, default=0, help="0: one padded batch")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--kv-block-size", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="pagedinfer's per-step token budget (default: 16384; 4096 at the cpu scale)",
    )
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--scheduling-policy",
        choices=("mixed", "prefill_first", "both"),
        default="mixed",
        help="pagedinfer's scheduling policy; both: one row each, side by side",
    )
    parser.add_argument("--progress", action="store_true", help="show pagedinfer's progress bar")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    scale = SCALES[args.scale or ("full" if args.device.startswith("cuda") else "cpu")]
    for key, value in scale.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.random_weights is None and args.model is None:
        args.random_weights = "qwen3-0.6b" if args.device.startswith("cuda") else "small"
    if args.repeats is None:
        args.repeats = 1 if scale is SCALES["full"] else 3
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = resolve_model(args)
    config = json.loads((Path(model) / "config.json").read_text())
    workload = make_workload(args, int(config["vocab_size"]))
    print(
        f"model {model}; {len(workload.prompts)} requests, prompts U{list(args.input_len)}, "
        f"outputs U{list(args.output_len)} ({workload.output_tokens} output tokens); "
        f"device: {describe_device(args.device)}; torch {torch.__version__}"
    )
    policies = ("mixed", "prefill_first") if args.scheduling_policy == "both" else None
    systems: list[Callable[[str, Workload, argparse.Namespace], Result]] = (
        [functools.partial(run_pagedinfer, policy=policy) for policy in policies]
        if policies
        else [functools.partial(run_pagedinfer, policy=args.scheduling_policy)]
    )
    if args.baselines != "none":
        systems += [BASELINES[name] for name in args.baselines.split(",")]
    runs: list[list[Result]] = [[] for _ in systems]
    for repeat in range(args.repeats):
        for index, system in enumerate(systems):
            result = system(model, workload, args)
            label = f" (run {repeat + 1}/{args.repeats})" if args.repeats > 1 else ""
            print(f"  {result.name}{label}: {result.throughput:.1f} tok/s")
            runs[index].append(result)
    summaries = [Summary(r[0].name, r) for r in runs]
    ours = summaries[0]
    print(
        f"\n| system | output tokens | time (s, median) | output tok/s (median) "
        f"| range over {args.repeats} run(s) | pagedinfer speed-up | CPU s (median) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for summary in summaries:
        low, high = summary.throughput_range
        print(
            f"| {summary.name} | {summary.runs[0].output_tokens} | {summary.median_seconds:.2f} "
            f"| {summary.median_throughput:.1f} | {low:.0f}-{high:.0f} "
            f"| {ours.median_throughput / summary.median_throughput:.2f}x "
            f"| {summary.median_cpu_seconds:.2f} |"
        )
    if args.json:
        payload = {
            "device": describe_device(args.device),
            "torch": torch.__version__,
            "args": {
                k: v
                for k, v in vars(args).items()
                if isinstance(v, (int, float, str, list, tuple, type(None)))
            },
            "results": [
                {
                    "name": summary.name,
                    "median_throughput": summary.median_throughput,
                    "runs": [asdict(r) | {"throughput": r.throughput} for r in summary.runs],
                }
                for summary in summaries
            ],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
