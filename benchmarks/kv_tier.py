"""Host KV tier side by side: multi-turn chat with a device pool too small for every history.

``--users`` conversations run ``--turns`` turns each; turn ``k`` of a user sends the whole
conversation so far (previous prompt, the answer, a new ``--message-len``-token message). The
users take turns one request at a time (user 0's turn, user 1's turn, ... then the next turn),
so between two turns of one user the others' histories pass through the device pool. The pool
(``--num-kv-blocks`` blocks of ``--block-size`` tokens) holds about two histories: without a
tier a user's history is evicted before the next turn and recomputed; with
``kv_offloading_size`` (``--tier-gib``) it is copied out when evicted and copied back in.

Both engines (no tier, tier) run in the same process, alternating round by round
(``--rounds``), on the random-weight ``small`` Qwen3 checkpoint (built once in
``--checkpoint-dir``); greedy, ``--max-tokens`` tokens per answer. Reported: prompt tokens
computed (``EngineStats.num_prompt_tokens``; the rest came from a cache), prompt tokens served
by the tier, the median and p90 time to first token of the requests after the first turn, and
the wall time. The outputs of both engines are checked to be identical.

A second table measures preemption: ``--preempt-requests`` requests of ``--preempt-prompt``
tokens generating ``--preempt-tokens`` each, all at once, in the same small pool, so running
requests are preempted. Without a tier a preempted request recomputes what was evicted of its
blocks meanwhile; with the tier those blocks come back by copy (preemption by swap, through
the prefix cache: only the partial last block is recomputed)::

    python benchmarks/kv_tier.py --rounds 3
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


class Result:
    def __init__(self) -> None:
        self.ttft: list[float] = []  # turns after the first
        self.prompt_computed = 0
        self.tier_hit_tokens = 0
        self.seconds = 0.0
        self.answers: list[list[int]] = []


def first_token_time(
    engine: Engine, prompt: list[int], params: SamplingParams
) -> tuple[float, list[int]]:
    """(seconds to the first token, the answer) of one request run alone."""
    started = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    ttft = None
    answer: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id != request_id:
                continue
            if ttft is None and output.outputs[0].token_ids:
                ttft = time.perf_counter() - started
            if output.finished:
                answer = list(output.outputs[0].token_ids)
    assert ttft is not None
    return ttft, answer


def run(model: str, tier_gib: float | None, args: argparse.Namespace) -> Result:
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    history: list[list[int]] = [[] for _ in range(args.users)]
    result = Result()
    with Engine(
        model,
        device="cpu",
        kv_block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        kv_offloading_size=tier_gib,
    ) as engine:
        started = time.perf_counter()
        for turn in range(args.turns):
            for user in range(args.users):
                message = [rng.randrange(10, 4000) for _ in range(args.message_len)]
                prompt = history[user] + message
                ttft, answer = first_token_time(engine, prompt, params)
                if turn:
                    result.ttft.append(ttft)
                history[user] = prompt + answer
                result.answers.append(answer)
        result.seconds = time.perf_counter() - started
        stats = engine.stats()
        result.prompt_computed = stats.num_prompt_tokens
        result.tier_hit_tokens = stats.host_tier.hit_tokens if stats.host_tier else 0
    return result


def run_preemption(
    model: str, tier_gib: float | None, args: argparse.Namespace
) -> tuple[int, int, int, float, list[list[int]]]:
    """(preemptions, prompt tokens computed, tokens from the tier, seconds, outputs)."""
    rng = random.Random(1)
    prompts = [
        [rng.randrange(10, 4000) for _ in range(args.preempt_prompt)]
        for _ in range(args.preempt_requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.preempt_tokens, ignore_eos=True)
    with Engine(
        model,
        device="cpu",
        kv_block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        kv_offloading_size=tier_gib,
    ) as engine:
        started = time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        stats = engine.stats()
        hits = stats.host_tier.hit_tokens if stats.host_tier else 0
        answers = [list(output.outputs[0].token_ids) for output in outputs]
        return stats.num_preemptions, stats.num_prompt_tokens, hits, seconds, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--message-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=80)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--tier-gib", type=float, default=1.0)
    parser.add_argument("--preempt-requests", type=int, default=12)
    parser.add_argument("--preempt-prompt", type=int, default=200)
    parser.add_argument("--preempt-tokens", type=int, default=200)
    parser.add_argument("--checkpoint-dir", default=".bench-cache/model/small")
    args = parser.parse_args()
    directory = Path(args.checkpoint_dir)
    if not (directory / "config.json").exists():
        build_random_checkpoint(directory, "small", seed=0)
    model = str(directory)
    run(model, None, args)  # warm-up, not counted
    configs: dict[str, float | None] = {
        "no tier": None,
        f"tier {args.tier_gib:g} GiB": args.tier_gib,
    }
    results: dict[str, list[Result]] = {name: [] for name in configs}
    preemption: dict[str, list[tuple[int, int, int, float, list[list[int]]]]] = {
        name: [] for name in configs
    }
    load_before = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name, tier in configs.items():
            results[name].append(run(model, tier, args))
            preemption[name].append(run_preemption(model, tier, args))
    load_after = os.getloadavg()[0]
    first = [runs[0].answers for runs in results.values()]
    identical = all(answers == first[0] for answers in first)
    total_prompt = (
        sum(args.message_len * (turn + 1) + args.max_tokens * turn for turn in range(args.turns))
        * args.users
    )
    print(
        f"{args.users} users x {args.turns} turns ({args.message_len}-token messages, "
        f"{args.max_tokens}-token answers, {total_prompt} prompt tokens sent), one request at "
        f"a time; device pool {args.num_kv_blocks} blocks x {args.block_size} tokens; "
        f"{len(os.sched_getaffinity(0))} CPUs, load average {load_before:.1f} before, "
        f"{load_after:.1f} after; {args.rounds} rounds; outputs identical: {identical}\n"
    )
    print(
        "| engine | prompt tokens computed | from the tier | TTFT median ms (turns 2+) "
        "| TTFT p90 ms | wall s (median) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        ttft = sorted(t for run_ in runs for t in run_.ttft)
        p90 = ttft[int(0.9 * (len(ttft) - 1))]
        print(
            f"| {name} | {runs[0].prompt_computed} | {runs[0].tier_hit_tokens} "
            f"| {statistics.median(ttft) * 1e3:.1f} | {p90 * 1e3:.1f} "
            f"| {statistics.median(r.seconds for r in runs):.2f} |"
        )
    same = len({str(runs[0][4]) for runs in preemption.values()}) == 1
    print(
        f"\nPreemption: {args.preempt_requests} requests x ({args.preempt_prompt} prompt + "
        f"{args.preempt_tokens} generated tokens) at once in the same pool; outputs identical: "
        f"{same}\n"
    )
    print("| engine | preemptions | prompt tokens computed | from the tier | wall s (median) |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in preemption.items():
        preempted, computed, hits, _, _ = runs[0]
        wall = statistics.median(run_[3] for run_ in runs)
        print(f"| {name} | {preempted} | {computed} | {hits} | {wall:.2f} |")


if __name__ == "__main__":
    main()
