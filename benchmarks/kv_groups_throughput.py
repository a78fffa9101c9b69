"""KV groups through the real engine: throughput of a Gemma-3-shaped model with its sliding
window honoured against the same model with the window ignored, at one fixed KV budget.

The model is a random-weight ``Gemma3ForCausalLM`` (``--layers`` layers, five sliding layers of
window ``--window`` to one full layer, as Gemma 3; tiny sizes so it runs on a CPU). "Window
ignored" is the same checkpoint with every ``layer_types`` entry ``full_attention`` (one KV
group, every layer in every block: what a server without hybrid KV groups holds). Both get
the same ``kv_cache_memory_bytes`` and the same requests (``--requests`` prompts of
``--prompt-len`` random tokens, ``--max-tokens`` greedy tokens each, all submitted at once),
one engine per run built before the clock starts, the two alternating for ``--rounds``
rounds. Reported per variant (median over rounds): the KV blocks the budget buys, generated
tokens per second of wall time, the most sequences running at once (sampled after every
step) and the preemptions.

    python benchmarks/kv_groups_throughput.py            # a few minutes on 2 CPU cores
    python benchmarks/kv_groups_throughput.py --quick    # a smoke test (seconds)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint


@dataclass(frozen=True, slots=True)
class Run:
    seconds: float
    generated: int
    max_running: int
    preemptions: int
    num_kv_blocks: int

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds


def gemma3_layer_types(num_layers: int) -> list[str]:
    """Five sliding layers to one full layer (Gemma 3's pattern)."""
    return [
        "full_attention" if (layer + 1) % 6 == 0 else "sliding_attention"
        for layer in range(num_layers)
    ]


def build_checkpoints(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The windowed checkpoint and its copy with every layer full attention."""
    windowed = build_random_checkpoint(
        root / "windowed",
        "tiny",
        architecture="Gemma3ForCausalLM",
        vocab_size=512,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=args.hidden // 4,
        query_pre_attn_scalar=args.hidden // 4,
        sliding_window=args.window,
        layer_types=tuple(gemma3_layer_types(args.layers)),
        max_position_embeddings=4096,
    )
    ignored = root / "window-ignored"
    shutil.copytree(windowed, ignored)
    config_path = ignored / "config.json"
    config = json.loads(config_path.read_text())
    config["layer_types"] = ["full_attention"] * args.layers
    config_path.write_text(json.dumps(config))
    return {"window honoured": windowed, "window ignored": ignored}


def run_once(checkpoint: Path, prompts: list[list[int]], args: argparse.Namespace) -> Run:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with Engine(
        checkpoint,
        device="cpu",
        kv_block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_bytes,
        max_model_len=args.prompt_len + args.max_tokens,
        max_num_batched_tokens=args.batched_tokens,
        num_threads=args.threads,
    ) as engine:
        for prompt in prompts:
            engine.add_request(prompt, params)
        max_running = 0
        generated = 0
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    generated += len(output.outputs[0].token_ids)
            max_running = max(max_running, engine.stats().num_running)
        seconds = time.perf_counter() - started
        stats = engine.stats()
    return Run(seconds, generated, max_running, stats.num_preemptions, stats.num_kv_blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batched-tokens", type=int, default=512)
    # The window-ignored model fits 4 sequences of the full length in this budget.
    parser.add_argument("--kv-bytes", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.max_tokens, args.prompt_len = 1, 4, 16, 32
    head_dim = args.hidden // 4
    # float32, one KV head: bytes of K and V of one token in one layer.
    token_layer_bytes = 2 * head_dim * 4
    full_len = args.prompt_len + args.max_tokens
    if args.kv_bytes is None:
        blocks_per_seq = -(-full_len // args.block_size)
        args.kv_bytes = 4 * blocks_per_seq * args.block_size * args.layers * token_layer_bytes
    print(
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"{platform.machine()} {platform.system()}"
    )
    print("command: python benchmarks/kv_groups_throughput.py " + " ".join(sys.argv[1:]))
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 512) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    results: dict[str, list[Run]] = {}
    with tempfile.TemporaryDirectory() as root:
        checkpoints = build_checkpoints(Path(root), args)
        for round_index in range(args.rounds):
            for name, checkpoint in checkpoints.items():
                run = run_once(checkpoint, prompts, args)
                results.setdefault(name, []).append(run)
                print(
                    f"round {round_index + 1} {name}: {run.tokens_per_second:.1f} tok/s, "
                    f"max running {run.max_running}, preemptions {run.preemptions}, "
                    f"{run.num_kv_blocks} blocks",
                    flush=True,
                )
    print(
        f"\n### {args.layers} layers (5 sliding of window {args.window} : 1 full), hidden "
        f"{args.hidden}, block {args.block_size}, KV budget {args.kv_bytes / 2**20:.2f} MiB; "
        f"{args.requests} requests of {args.prompt_len} + {args.max_tokens} tokens "
        f"(median of {args.rounds})\n"
    )
    print("| variant | KV blocks | tokens/s | max running | preemptions |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in results.items():
        print(
            f"| {name} | {runs[0].num_kv_blocks} "
            f"| {statistics.median(r.tokens_per_second for r in runs):.1f} "
            f"| {statistics.median(r.max_running for r in runs):.0f} "
            f"| {statistics.median(r.preemptions for r in runs):.0f} |"
        )


if __name__ == "__main__":
    main()
