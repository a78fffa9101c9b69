"""Beam search with and without the prefix cache: how much of each step's prompt the beams
share (``LLM.beam_search``, docs/api.md "Beam search").

Each step of beam search submits every live beam as a prompt of token ids for one token; with
prefix caching the beams find the full KV blocks of their prompt (and of the generated tokens
they have in common) in the cache and compute only the tail. Reported per configuration: the
prompt tokens the engine computed over one whole search (without the cache, every token
submitted), and the wall time (median of ``--repeats``; a fresh engine per configuration,
the prefix cache emptied before each search, one warm-up search not timed). The beams found
must be the same either way (checked).

    python benchmarks/beam_search.py                      # small random model, CPU
    python benchmarks/beam_search.py --prompt-len 512 --beam-width 4 --max-tokens 32
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


def _run(checkpoint: Path, args: argparse.Namespace, caching: bool) -> dict[str, Any]:
    from pagedinfer import LLM, BeamSearchParams

    params = BeamSearchParams(
        beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True
    )
    prompts = [
        [(7 * i + 13 * p) % 4000 + 1 for i in range(args.prompt_len)] for p in range(args.prompts)
    ]
    with LLM(
        model=str(checkpoint),
        device=args.device,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        kv_block_size=args.block_size,
        enable_prefix_caching=caching,
        num_threads=args.threads,
    ) as llm:
        llm.beam_search(prompts, params)  # warm-up
        times = []
        computed = []
        found: list[Any] = []
        for _ in range(args.repeats):
            llm.reset_prefix_cache()
            before = llm.stats().num_prompt_tokens
            start = time.perf_counter()
            found = llm.beam_search(prompts, params)
            times.append(time.perf_counter() - start)
            computed.append(llm.stats().num_prompt_tokens - before)
    assert len(set(computed)) == 1, computed
    return {
        "caching": caching,
        "computed": computed[0],
        "seconds": statistics.median(times),
        "tokens": [[s.tokens for s in output.sequences] for output in found],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

    with tempfile.TemporaryDirectory() as directory:
        checkpoint = build_random_checkpoint(Path(directory), "small", seed=0)
        rows = [_run(checkpoint, args, caching) for caching in (True, False)]
    assert rows[0]["tokens"] == rows[1]["tokens"], "the beams differ with and without the cache"
    print(
        f"{args.prompts} prompts of {args.prompt_len} tokens, beam_width {args.beam_width}, "
        f"max_tokens {args.max_tokens}, block size {args.block_size}, {args.device}\n"
    )
    print("| prefix caching | prompt tokens computed | time (s, median) |")
    print("|---|---:|---:|")
    for row in rows:
        print(f"| {'on' if row['caching'] else 'off'} | {row['computed']} | {row['seconds']:.2f} |")


if __name__ == "__main__":
    main()
