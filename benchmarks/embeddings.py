"""Embeddings per second: pagedinfer's pooling runner against transformers batched with
padding, in the same run, on the same prompts (last-token pooling, normalized).

pagedinfer (``LLM(runner="pooling")``) packs the prompts of a step back to back (no padding)
under its token budget, chunking long ones; transformers runs the decoder
(``AutoModelForCausalLM(...).model``, no LM head) on batches of ``--batch-size`` prompts
padded to the longest, and pools each prompt's last real token. Prompts are random token
ids of mixed lengths (``--min-len`` .. ``--max-len``, no shared prefixes). Each side gets a
warm-up pass, then ``--repeats`` timed passes, the two sides alternating (median and range);
the two sides' embeddings must agree (largest difference reported).

    python benchmarks/embeddings.py                               # small random model, CPU
    python benchmarks/embeddings.py --checkpoint DIR --device cuda --prompts 2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def _prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.prompts)]
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def _pagedinfer(checkpoint: Path, prompts: list[list[int]], args: argparse.Namespace) -> Any:
    """The engine and a timed pass over the prompts (the prefix cache emptied first)."""
    from pagedinfer import LLM

    llm = LLM(
        model=str(checkpoint),
        runner="pooling",
        pooler_config={"pooling_type": "LAST", "normalize": True},
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_len + 16,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
    )

    def run() -> list[list[float]]:
        llm.reset_prefix_cache()
        return [output.outputs.embedding for output in llm.embed(prompts, use_tqdm=False)]

    return llm, run


def _transformers(checkpoint: Path, prompts: list[list[int]], args: argparse.Namespace) -> Any:
    """A pass over the prompts in padded batches (the decoder without its LM head)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype[args.dtype])
    decoder = model.model.to(device).eval()

    def run() -> list[list[float]]:
        vectors: list[list[float]] = []
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start : start + args.batch_size]
            width = max(len(p) for p in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, prompt in enumerate(batch):
                ids[row, : len(prompt)] = torch.tensor(prompt)
                mask[row, : len(prompt)] = 1
            with torch.inference_mode():
                out = decoder(input_ids=ids.to(device), attention_mask=mask.to(device))
                last = mask.sum(1).to(device) - 1
                pooled = out.last_hidden_state[torch.arange(len(batch), device=device), last]
                pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
            vectors += pooled.cpu().tolist()
        return vectors

    return run


def _timed(run: Any, device: str) -> tuple[float, list[list[float]]]:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    vectors = run()
    return time.perf_counter() - start, vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None, help="default: a random 'small' model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16, help="transformers' batches")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint
    from pagedinfer.adapters.models.registry import read_model_config

    with tempfile.TemporaryDirectory() as directory:
        checkpoint = (
            Path(args.checkpoint)
            if args.checkpoint
            else build_random_checkpoint(Path(directory), "small", seed=0)
        )
        prompts = _prompts(args, read_model_config(checkpoint).vocab_size)
        llm, ours_run = _pagedinfer(checkpoint, prompts, args)
        theirs_run = _transformers(checkpoint, prompts, args)
        ours_run()  # warm-up passes
        theirs_run()
        # The two sides alternate, pass by pass, so that a busy machine slows both alike.
        ours_times, theirs_times = [], []
        for _ in range(args.repeats):
            seconds, our_vectors = _timed(ours_run, args.device)
            ours_times.append(seconds)
            seconds, their_vectors = _timed(theirs_run, args.device)
            theirs_times.append(seconds)
        llm.close()
    ours, theirs = statistics.median(ours_times), statistics.median(theirs_times)
    difference = max(
        abs(a - b)
        for mine, other in zip(our_vectors, their_vectors, strict=True)
        for a, b in zip(mine, other, strict=True)
    )
    tokens = sum(len(p) for p in prompts)
    padded = sum(
        len(prompts[s : s + args.batch_size])
        * max(len(p) for p in prompts[s : s + args.batch_size])
        for s in range(0, len(prompts), args.batch_size)
    )
    print(
        f"{len(prompts)} prompts of {args.min_len}..{args.max_len} tokens ({tokens} tokens; "
        f"transformers pads to {padded}), {args.device}, {args.dtype}, {args.threads} threads; "
        f"largest difference {difference:.2e}\n"
    )
    print("| engine | embeddings/s (median) | prompt tokens/s | time (s, median) | range (s) |")
    print("|---|---:|---:|---:|---:|")
    for name, seconds, times in (
        ("pagedinfer (runner=pooling)", ours, ours_times),
        (f"transformers, batches of {args.batch_size} padded", theirs, theirs_times),
    ):
        print(
            f"| {name} | {len(prompts) / seconds:.1f} | {tokens / seconds:.0f} | "
            f"{seconds:.3f} | {min(times):.2f}-{max(times):.2f} |"
        )
    print(f"\nspeed-up: {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
