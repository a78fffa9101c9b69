"""KV block size side by side: prefix-cache hit rate and throughput on chat-like traffic.

Prefix caching shares whole blocks only, so the block size decides how much of a repeated
prompt is found in the cache. The workload is what a chat server sees: ``--users``
conversations that share one system prompt (``--system-len`` tokens), each running
``--turns`` turns; turn ``k`` sends the whole conversation so far (the previous prompt, the
answer, a new user message of ``--message-len`` tokens). All users' turn ``k`` run as one
batch. Greedy, ``--max-tokens`` generated per turn, random token ids (the random-weight
``small`` Qwen3 checkpoint, built once in ``--checkpoint-dir``).

Each block size runs in a fresh engine, the sizes alternating round by round (``--rounds``)
so that the machine's other load falls on all of them alike. The table shows the hit rate
(the fraction of looked-up prompt tokens served from the cache, ``EngineStats``), the median
wall time and the tokens (prompt + generated) per second::

    python benchmarks/block_size.py --block-sizes 16 32 64 256 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

# Run from a plain checkout: this repository's src/ comes first on the import path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint


def conversations(
    users: int, turns: int, system_len: int, message_len: int, seed: int = 0
) -> list[list[list[int]]]:
    """Per turn, per user: the new user message's token ids (turn 0 starts with the shared
    system prompt)."""
    rng = random.Random(seed)
    system = [rng.randrange(10, 4000) for _ in range(system_len)]
    messages = [
        [[rng.randrange(10, 4000) for _ in range(message_len)] for _ in range(users)]
        for _ in range(turns)
    ]
    for user in range(users):
        messages[0][user] = system + messages[0][user]
    return messages


def run(model: str, block_size: int, args: argparse.Namespace) -> tuple[float, float, int]:
    """(hit rate, seconds, tokens processed) of one run in a fresh engine."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    turns = conversations(args.users, args.turns, args.system_len, args.message_len)
    history: list[list[int]] = [[] for _ in range(args.users)]
    tokens = 0
    with Engine(
        model,
        device="cpu",
        kv_block_size=block_size,
        max_model_len=4096,
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
    ) as engine:
        started = time.perf_counter()
        for turn in turns:
            prompts = [history[user] + turn[user] for user in range(args.users)]
            outputs = engine.generate(prompts, params, use_tqdm=False)
            for user, output in enumerate(outputs):
                answer = list(output.outputs[0].token_ids)
                history[user] = prompts[user] + answer
                tokens += len(prompts[user]) + len(answer)
        seconds = time.perf_counter() - started
        hit_rate = engine.stats().prefix_cache_hit_rate
    return hit_rate, seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-len", type=int, default=200)
    parser.add_argument("--message-len", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--checkpoint-dir", default=".bench-cache/model/small")
    args = parser.parse_args()
    directory = Path(args.checkpoint_dir)
    if not (directory / "config.json").exists():
        build_random_checkpoint(directory, "small", seed=0)
    model = str(directory)
    run(model, args.block_sizes[0], args)  # warm-up, not counted
    results: dict[int, list[tuple[float, float, int]]] = {size: [] for size in args.block_sizes}
    load_before = os.getloadavg()[0]
    for _ in range(args.rounds):
        for size in args.block_sizes:
            results[size].append(run(model, size, args))
    load_after = os.getloadavg()[0]
    requests = args.users * args.turns
    print(
        f"{requests} chat requests ({args.users} users x {args.turns} turns, a shared "
        f"{args.system_len}-token system prompt, {args.message_len}-token messages, "
        f"{args.max_tokens} tokens per answer); {len(os.sched_getaffinity(0))} CPUs, load "
        f"average {load_before:.1f} before, {load_after:.1f} after; {args.rounds} rounds\n"
    )
    print("| block size | prefix hit rate | wall s (median) | range | tokens/s (median) |")
    print("|---:|---:|---:|---:|---:|")
    for size, runs in results.items():
        seconds = [run_seconds for _, run_seconds, _ in runs]
        tokens = runs[0][2]
        median = statistics.median(seconds)
        print(
            f"| {size} | {runs[0][0]:.2f} | {median:.2f} | {min(seconds):.2f}-{max(seconds):.2f} "
            f"| {tokens / median:.0f} |"
        )


if __name__ == "__main__":
    main()
