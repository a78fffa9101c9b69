"""FP8 KV cache on the CPU: capacity and accuracy against a float32 cache on the same model.

Capacity: blocks of Qwen3-0.6B's cache (28 layers, 8 KV heads of 128, 256-token blocks) in
the same memory, for bfloat16, float32 and FP8 (pure arithmetic: ``kv_block_bytes``).

Accuracy, per attention backend (``torch``; ``triton`` runs its kernels in Triton's CPU
interpreter): each prompt is prefilled and then decoded greedily for ``--max-tokens`` tokens
with a float32 cache (the reference); the same model with an FP8 cache is then fed the
reference's tokens (teacher forcing: the sampled token is overridden), so both see the same
contexts. At every decode position we compare the next-token distributions:

* ``max |dlogprob|``: the largest change of the log-probability of the reference's chosen
  token;
* ``KL``: ``KL(reference || fp8)`` of the whole next-token distribution, mean and max over
  positions.

Two checkpoints: ``random`` (transformers' initialisation: ``|K|``, ``|V|`` around 1) and
``realistic``, the same random weights rescaled so that the activations have a real model's
magnitudes (Qwen3-style ``k_norm`` gains put most of ``|K|`` between 1 and 20 and two
outlier rotary pairs up to ~50; ``v_proj`` scaled down so that ``|V|`` stays below ~0.025,
mostly below 0.01, with ``o_proj`` scaled up by as much so the residual stream is unchanged).

The broken quantizers (``--broken``) are what the test's bound must catch: scales of 1.0 (vLLM's
default) instead of calibrated ones, and truncation instead of round-to-nearest-even (torch
backend only: they replace the torch store's quantizer).

    python benchmarks/fp8_kv.py                       # torch backend, markdown on stdout
    python benchmarks/fp8_kv.py --backend triton      # the Triton kernels, interpreted
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


@dataclass(frozen=True, slots=True)
class Accuracy:
    """FP8 against float32 at the same positions (see the module docstring)."""

    max_abs_dlogprob: float
    mean_kl: float
    max_kl: float
    positions: int


# The shape of the accuracy checkpoints: small enough for the interpreter, GQA, head_dim 64.
SPEC_OVERRIDES: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


# Gains of the outlier rotary pairs of k_norm (|K| up to ~50), and the factor on v_proj
# (|V| up to ~0.025, mostly below 0.01; o_proj is divided by it).
OUTLIER_GAIN = 15.0
V_SCALE = 0.005


def build_checkpoint(path: Path, kind: str, *, seed: int = 0) -> Path:
    """A random Qwen3 checkpoint at ``path``; ``kind="realistic"`` rescales it so that K and
    V have a real model's magnitudes (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

    checkpoint = build_random_checkpoint(path, "tiny", seed=seed, **SPEC_OVERRIDES)
    if kind == "random":
        return checkpoint
    assert kind == "realistic", kind
    import torch

    (file,) = sorted(checkpoint.glob("*.safetensors"))
    tensors = load_file(str(file))
    generator = torch.Generator().manual_seed(seed + 1)
    head_dim = SPEC_OVERRIDES["head_dim"]
    half = head_dim // 2
    for name in list(tensors):
        tensor = tensors[name]
        if name.endswith("k_norm.weight"):
            # Gains of 1-8, and two low-frequency rotary pairs (the last dims of each half)
            # with larger gains: |K| mostly 1-20, outliers up to ~50, as in real layers.
            gains = 1.0 + 7.0 * torch.rand(head_dim, generator=generator)
            for dim in (half - 2, half - 1):
                gains[dim] = gains[dim + half] = OUTLIER_GAIN
            tensors[name] = gains.to(tensor.dtype)
        elif name.endswith("q_norm.weight"):
            tensors[name] = torch.full_like(tensor, 0.25)
        elif name.endswith("v_proj.weight"):
            tensors[name] = tensor * V_SCALE  # |V| mostly below 0.05
        elif name.endswith("o_proj.weight"):
            tensors[name] = tensor / V_SCALE  # the attention output as large as before
    save_file(tensors, str(file), metadata={"format": "pt"})
    return checkpoint


def make_runner(checkpoint: Path, backend: str, kv_cache_dtype: str) -> Any:
    import torch

    from pagedinfer.adapters.model_runner import ModelRunner
    from pagedinfer.adapters.runner_config import RunnerConfig

    return ModelRunner(
        RunnerConfig(
            model_path=str(checkpoint),
            device=torch.device("cpu"),
            dtype=torch.float32,
            block_size=16,
            attention_backend=backend,
            max_num_seqs=4,
            max_num_batched_tokens=512,
            max_model_len=256,
            num_kv_blocks=32,
            kv_cache_dtype=kv_cache_dtype,
        )
    )


def decode_logprobs(
    runner: Any, prompt: Sequence[int], max_tokens: int, forced: Sequence[int] | None = None
) -> tuple[list[int], Any]:
    """Prefill ``prompt``, decode ``max_tokens`` tokens greedily (or ``forced`` ones); the
    tokens and the next-token log-probabilities at each position, ``[max_tokens, vocab]``."""
    import torch

    from pagedinfer.domain import SamplingParams, Scheduler, SchedulerConfig, Sequence

    recorded: list[torch.Tensor] = []
    model = runner.model
    original = model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor | None:
        logits: torch.Tensor | None = original(hidden)
        if logits is None:
            return None
        assert logits.shape[0] == 1, "one sequence at a time"
        recorded.append(torch.log_softmax(logits[0].to(torch.float64), dim=-1))
        if forced is not None:  # teacher forcing: greedy picks the reference's token
            logits = torch.full_like(logits, -1e9)
            logits[0, forced[len(recorded) - 1]] = 0.0
        return logits

    config = runner.config
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=runner.num_kv_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_prefix_caching=False,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seq = Sequence(0, list(prompt), params)
    scheduler.add(seq)
    model.compute_logits = capture
    try:
        while (plan := scheduler.schedule()) is not None:
            scheduler.postprocess(plan, runner.execute(plan).sampled_token_ids)
    finally:
        del model.compute_logits
    return list(seq.completion_token_ids), torch.stack(recorded)


def compare(reference: Any, tokens: Sequence[int], other: Any) -> tuple[float, list[float]]:
    """Largest |dlogprob| of the chosen tokens and KL(reference || other) per position."""
    import torch

    index = torch.tensor(tokens)[:, None]
    dlogprob = (reference.gather(1, index) - other.gather(1, index)).abs().max().item()
    kl = (reference.exp() * (reference - other)).sum(-1)
    return float(dlogprob), [float(x) for x in kl]


def prompt_set(count: int = 6, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """Random prompts of 16-96 tokens (crossing several 16-token blocks)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(16, 96))] for _ in range(count)]


@contextmanager
def broken_quantizer(kind: str | None) -> Iterator[Callable[[Any], None]]:
    """Plant a broken quantizer in the torch store (``"truncate"``) or scales of 1.0
    (``"unit_scales"``); yields what to do to a freshly built runner."""
    import torch

    from pagedinfer.adapters.attention import torch_ref
    from pagedinfer.adapters.kv_cache import fp8_max, unit_scales

    def nothing(runner: Any) -> None:
        return None

    if kind is None:
        yield nothing
        return
    if kind == "unit_scales":

        def unit(runner: Any) -> None:
            runner.kv_scales.copy_(unit_scales().expand_as(runner.kv_scales))

        yield unit
        return
    assert kind == "truncate", kind
    original = torch_ref.quantize_fp8

    def truncating(x: torch.Tensor, inverse_scale: torch.Tensor, dtype: torch.dtype) -> Any:
        limit = fp8_max(dtype)
        y = (x.to(torch.float32) * inverse_scale).clamp(-limit, limit)
        rounded = y.to(dtype)
        away = rounded.to(torch.float32).abs() > y.abs()  # rounded up: one step toward 0
        raw = rounded.view(torch.uint8).clone()
        raw[away] -= 1
        return raw.view(dtype)

    torch_ref.quantize_fp8 = truncating  # type: ignore[assignment]
    try:
        yield nothing
    finally:
        torch_ref.quantize_fp8 = original


def measure(
    checkpoint: Path,
    backend: str,
    kv_cache_dtype: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    broken: str | None = None,
    reference: list[tuple[list[int], Any]] | None = None,
) -> tuple[Accuracy, list[tuple[list[int], Any]]]:
    """FP8 (``kv_cache_dtype``) against a float32 cache on ``prompts``; also returns the
    reference runs (pass them back to reuse them)."""
    if reference is None:
        base = make_runner(checkpoint, backend, "auto")
        reference = [decode_logprobs(base, prompt, max_tokens) for prompt in prompts]
        base.close()
    with broken_quantizer(broken) as adjust:
        runner = make_runner(checkpoint, backend, kv_cache_dtype)
        adjust(runner)
        worst = 0.0
        kls: list[float] = []
        for prompt, (tokens, expected) in zip(prompts, reference, strict=True):
            _, got = decode_logprobs(runner, prompt, max_tokens, forced=tokens)
            dlogprob, kl = compare(expected, tokens, got)
            worst = max(worst, dlogprob)
            kls += kl
        runner.close()
    accuracy = Accuracy(
        max_abs_dlogprob=worst,
        mean_kl=sum(kls) / len(kls),
        max_kl=max(kls),
        positions=len(kls),
    )
    return accuracy, reference


def capacity_lines() -> list[str]:
    import torch

    from pagedinfer.adapters.kv_cache import kv_block_bytes

    memory = 16 << 30
    lines = [
        "| KV cache dtype | bytes per 256-token block | blocks in 16 GiB | tokens |",
        "|---|---:|---:|---:|",
    ]
    for name, dtype in (
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("fp8 (e4m3 / e5m2)", torch.float8_e4m3fn),
    ):
        size = kv_block_bytes(
            num_layers=28, block_size=256, num_kv_heads=8, head_dim=128, dtype=dtype
        )
        blocks = memory // size
        lines.append(f"| {name} | {size:,} | {blocks:,} | {blocks * 256:,} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("torch", "triton"), default="torch")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--broken", action="store_true", help="also measure the planted broken quantizers"
    )
    args = parser.parse_args(argv)
    if args.backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    print("## Capacity (Qwen3-0.6B's KV shape)\n")
    print("\n".join(capacity_lines()))
    print(f"\n## Accuracy against a float32 cache ({args.backend} backend)\n")
    print("| checkpoint | kv_cache_dtype | quantizer | max abs dlogprob | mean KL | max KL |")
    print("|---|---|---|---:|---:|---:|")
    prompts = prompt_set(args.prompts)
    runs: list[tuple[str, str | None]] = [("fp8_e4m3", None), ("fp8_e5m2", None)]
    if args.broken:
        runs += [("fp8_e4m3", "unit_scales"), ("fp8_e4m3", "truncate")]
    with tempfile.TemporaryDirectory() as scratch:
        for kind in ("random", "realistic"):
            checkpoint = build_checkpoint(Path(scratch) / kind, kind)
            reference = None
            for dtype, broken in runs:
                accuracy, reference = measure(
                    checkpoint,
                    args.backend,
                    dtype,
                    prompts,
                    args.max_tokens,
                    broken=broken,
                    reference=reference,
                )
                label = {
                    None: "calibrated, RNE",
                    "unit_scales": "scale 1.0",
                    "truncate": "truncate",
                }
                print(
                    f"| {kind} | {dtype} | {label[broken]} | {accuracy.max_abs_dlogprob:.4f} | "
                    f"{accuracy.mean_kl:.2e} | {accuracy.max_kl:.2e} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
