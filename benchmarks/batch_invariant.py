"""What ``batch_invariant=True`` costs: the same workload with and without it, in turns.

The workload: ``--requests`` prompts of random token ids (lengths uniform in
``[--min-prompt, --max-prompt]``), ``--max-tokens`` tokens each, greedy, ``ignore_eos``, on a
random checkpoint of the ``--preset`` shape (``small`` by default: 4 layers, hidden 256). Each
round runs the workload once per mode in one engine each (built before the clock starts, one
warm-up generate first); output tokens per second of wall time, median and best of
``--rounds``. It also says whether the outputs of the two modes are the same tokens (they need
not be: the invariant mode computes with other splits).

    python benchmarks/batch_invariant.py                      # CPU, markdown on stdout
    python benchmarks/batch_invariant.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import torch

    from pagedinfer import Engine, SamplingParams
    from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = build_random_checkpoint(Path(scratch), args.preset, seed=0)
        vocab = 4096 if args.preset == "small" else 512
        prompts = [
            [rng.randrange(vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
            for _ in range(args.requests)
        ]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        engines = {
            mode: Engine(
                checkpoint,
                device=args.device,
                dtype=args.dtype,
                kv_block_size=16,
                max_model_len=args.max_prompt + args.max_tokens,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=False,
                batch_invariant=mode == "batch_invariant",
            )
            for mode in ("default", "batch_invariant")
        }
        tokens: dict[str, list[list[int]]] = {}
        rates: dict[str, list[float]] = {mode: [] for mode in engines}
        for engine in engines.values():
            engine.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        for round_index in range(args.rounds):
            for mode, engine in engines.items():
                started = time.perf_counter()
                outputs = engine.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - started
                tokens[mode] = [out.outputs[0].token_ids for out in outputs]
                generated = sum(len(ids) for ids in tokens[mode])
                rates[mode].append(generated / seconds)
                print(f"round {round_index + 1} {mode}: {rates[mode][-1]:.1f} tok/s", flush=True)
        for engine in engines.values():
            engine.close()
    default, invariant = (statistics.median(rates[mode]) for mode in engines)
    print()
    print(
        f"{args.preset} preset, {args.device} {args.dtype}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
        f"{args.requests} requests, prompts {args.min_prompt}-{args.max_prompt}, "
        f"{args.max_tokens} tokens each, max_num_batched_tokens {args.max_num_batched_tokens}"
    )
    print()
    print("| mode | output tok/s (median / best) |")
    print("|---|---:|")
    for mode in engines:
        print(f"| {mode} | {statistics.median(rates[mode]):.1f} / {max(rates[mode]):.1f} |")
    print()
    print(f"batch_invariant / default (median): {invariant / default:.2f}")
    print(f"same tokens in both modes: {tokens['default'] == tokens['batch_invariant']}")


if __name__ == "__main__":
    main()
