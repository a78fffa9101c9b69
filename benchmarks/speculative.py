"""Speculative decoding (issue 26): latency and throughput with and without it, side by side.

One process, one engine per configuration on the same random target checkpoint, identical
but for ``speculative_config``:

* ``none``: no speculation (the baseline);
* ``ngram k=K``: prompt lookup (``prompt_lookup_min`` 1, ``prompt_lookup_max`` 4);
* ``draft=target k=K``: the target checkpoint as its own draft model. The drafts are the
  target's own greedy tokens, so greedy acceptance is ~100 %: the upper bound of what a draft
  model can give, paying for a draft as large as the target;
* ``draft=small k=K``: a truly smaller random draft (same vocabulary, 1 layer, hidden 128)
  with other weights: it almost never agrees with the target, so this is the lower bound
  (the cost of drafting and verifying for nothing).

The draft-model rows are skipped, with a note, if the engine refuses ``method="draft_model"``.

Workloads (``--batch`` requests at once, 1 and 8 by default; 32-token random prompts, 128
output tokens, greedy, ``ignore_eos``):

* ``loop``: plain greedy decoding. A random-weight model falls into a loop within a few
  tokens (with the ``small`` preset's weights it repeats one token), so the n-gram lookup is
  right nearly every time: the best case of prompt lookup, not a typical one;
* ``no-loop``: greedy with ``frequency_penalty=0.5``, which breaks those loops: the model
  wanders, the n-gram lookup still finds earlier tokens to propose, and they are wrong: the
  worst case (verification cost, nothing gained). Draft models decode without the penalty.

**Random weights make the acceptance rates synthetic**: a real model on real text (code
edits, summaries that copy their input, retrieval answers) lands somewhere in between, and
the speedup follows its acceptance rate (printed next to each row). Every greedy output is
checked against the baseline's (``same tokens``): speculation must not change them.

Each round runs every workload on every engine in turn (``--rounds`` rounds, so drifts of a
shared machine hit all alike); the table gives medians over rounds of: the mean time from
submission to the last token per request (``request ms``), that divided by its output tokens
(``ms/token``), and output tokens per second of wall time (``tok/s``), with the ratio of
the baseline's ``ms/token`` to the row's (``speedup``). One torch thread by default
(``--threads``), on the CPU by default (``--device cuda`` for a GPU).

    python benchmarks/speculative.py --rounds 5
    python benchmarks/speculative.py --target 29m --rounds 3 --only loop
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run from a plain checkout: this repository's src/ comes first on the import path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

# The random targets: the ``small`` preset (4 layers, hidden 256, vocabulary 4096; ~4 M
# parameters) and a ~29 M-parameter Qwen3 (6 layers, hidden 512, 8 / 4 heads of 64, MLP 1536,
# vocabulary 20480, tied embeddings; no tokenizer).
TARGETS: dict[str, dict[str, Any]] = {
    "small": {},
    "29m": {
        "vocab_size": 20480,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
}
# The smaller draft: the target's vocabulary, one layer, hidden 128, other weights (seed 1)
# and an output layer of its own: with tied embeddings and small weights a random model's
# greedy token is its input token (the residual stream is mostly the input's embedding), so a
# tied draft would agree with a tied target on every loop.
DRAFT: dict[str, Any] = {
    "tie_word_embeddings": False,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 128

Workload = tuple[list[list[int]], SamplingParams]


@dataclass
class Run:
    """One workload on one engine: means over its requests, and the spec_decode deltas."""

    request_ms: float
    ms_per_token: float
    tokens_per_s: float
    tokens: list[list[int]]
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0


@dataclass
class Results:
    runs: dict[tuple[str, str], list[Run]] = field(default_factory=dict)


def checkpoint(cache: Path, name: str, seed: int, **overrides: Any) -> Path:
    """A random checkpoint under ``cache``, built once per shape (the name holds a digest of
    the shape, so that a changed shape is built anew)."""
    shape = hashlib.sha256(repr((seed, sorted(overrides.items()))).encode()).hexdigest()[:8]
    directory = cache / f"{name}-{shape}"
    if not (directory / "config.json").exists():
        build_random_checkpoint(directory, "small", seed=seed, **overrides)
    return directory


def workloads(vocab: int, batches: list[int]) -> dict[str, Workload]:
    rng = random.Random(0)
    loads: dict[str, Workload] = {}
    for batch in batches:
        prompts = [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
        common = {"temperature": 0.0, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True}
        loads[f"loop b={batch}"] = (prompts, SamplingParams(**common))  # type: ignore[arg-type]
        loads[f"no-loop b={batch}"] = (
            prompts,
            SamplingParams(frequency_penalty=0.5, **common),  # type: ignore[arg-type]
        )
    return loads


def measure(engine: Engine, workload: Workload) -> Run:
    """Submit every request at once, step until all finish; time each request's end."""
    prompts, params = workload
    before = engine.stats()
    start = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    ends: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                ends[output.request_id] = time.perf_counter() - start
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    wall = time.perf_counter() - start
    after = engine.stats()
    counts = [len(tokens[i]) for i in ids]
    return Run(
        request_ms=1e3 * statistics.mean(ends[i] for i in ids),
        ms_per_token=1e3 * statistics.mean(ends[i] / n for i, n in zip(ids, counts, strict=True)),
        tokens_per_s=sum(counts) / wall,
        tokens=[tokens[i] for i in ids],
        drafts=after.spec_decode_num_drafts - before.spec_decode_num_drafts,
        draft_tokens=after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
        accepted=after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
    )


def engines(
    target: Path, draft: Path, ks: list[int], options: dict[str, Any], with_draft: bool
) -> dict[str, Engine]:
    """The baseline and each speculative configuration; draft-model ones that the engine
    refuses are left out with a note."""
    configs: dict[str, dict[str, Any] | None] = {"none": None}
    for k in ks:
        configs[f"ngram k={k}"] = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        }
    if with_draft:
        for k in ks:
            for label, path in (("target", target), ("small", draft)):
                configs[f"draft={label} k={k}"] = {
                    "method": "draft_model",
                    "model": str(path),
                    "num_speculative_tokens": k,
                }
    built: dict[str, Engine] = {}
    for name, config in configs.items():
        try:
            built[name] = Engine(target, speculative_config=config, **options)
        except Exception as error:  # any refusal: report it and go on
            if config is None or config["method"] != "draft_model":
                raise
            print(f"note: {name} skipped: {type(error).__name__}: {error}", flush=True)
    return built


def table(results: Results, names: list[str], loads: list[str]) -> list[str]:
    lines = [
        "| workload | config | request ms | ms/token | tok/s | speedup | acceptance | "
        "mean acceptance length | same tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for load in loads:
        baseline = results.runs[(load, "none")]
        base_ms = statistics.median(r.ms_per_token for r in baseline)
        for name in names:
            runs = results.runs[(load, name)]
            per_token = statistics.median(r.ms_per_token for r in runs)
            draft_tokens = sum(r.draft_tokens for r in runs)
            rows = sum(r.drafts for r in runs)
            accepted = sum(r.accepted for r in runs)
            speculative = name != "none"
            acceptance = f"{accepted / draft_tokens:.1%}" if draft_tokens else "-"
            length = f"{1 + accepted / rows:.2f}" if rows else "-"
            same = all(r.tokens == b.tokens for r, b in zip(runs, baseline, strict=True))
            lines.append(
                f"| {load} | {name} | {statistics.median(r.request_ms for r in runs):.0f} | "
                f"{per_token:.2f} | {statistics.median(r.tokens_per_s for r in runs):.0f} | "
                f"{base_ms / per_token:.2f}x | {acceptance if speculative else ''} | "
                f"{length if speculative else ''} | {'yes' if same else 'NO'} |"
            )
    return lines


def run(
    target: Path,
    draft: Path,
    options: dict[str, Any],
    ks: list[int],
    batches: list[int],
    rounds: int,
    only: list[str] | None = None,
    with_draft: bool = True,
) -> list[str]:
    """Every workload on every engine, ``rounds`` times in turn; the markdown table."""
    vocab = int(json.loads((target / "config.json").read_text())["vocab_size"])
    built = engines(target, draft, ks, options, with_draft)
    try:
        loads = {
            name: load
            for name, load in workloads(vocab, batches).items()
            if not only or any(name.startswith(prefix) for prefix in only)
        }
        for engine in built.values():  # warm-up
            engine.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=8), use_tqdm=False)
        results = Results()
        for round_index in range(rounds):
            for load_name, load in loads.items():
                for name, engine in built.items():
                    results.runs.setdefault((load_name, name), []).append(measure(engine, load))
            print(f"round {round_index + 1} done", file=sys.stderr, flush=True)
        return table(results, list(built), list(loads))
    finally:
        for engine in built.values():
            engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", choices=sorted(TARGETS), default="small")
    parser.add_argument("--cache-dir", default=".bench-cache")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--k", type=int, nargs="+", default=[3], help="num_speculative_tokens")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--only", nargs="*", help="workloads whose name starts with one of")
    parser.add_argument("--no-draft-model", action="store_true", help="n-gram rows only")
    args = parser.parse_args()
    cache = Path(args.cache_dir)
    spec = TARGETS[args.target]
    target = checkpoint(cache, f"spec-target-{args.target}", 0, **spec)
    vocab = spec.get("vocab_size", 4096)
    draft = checkpoint(cache, f"spec-draft-v{vocab}", 1, vocab_size=vocab, **DRAFT)
    options: dict[str, Any] = {
        "device": args.device,
        "kv_block_size": 16,
        "max_model_len": 512,
        "num_kv_blocks": 256,
    }
    if args.device == "cpu":
        options["num_threads"] = args.threads  # torch's threads: process-wide
    lines = run(
        target, draft, options, args.k, args.batch, args.rounds, args.only, not args.no_draft_model
    )
    load_avg = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(
        f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{load_avg} (at the end), torch {torch.__version__}, device {args.device}, "
        f"{args.threads} torch thread(s), {args.rounds} rounds, target {target} "
        f"({args.target}), draft {draft}; {PROMPT_TOKENS}-token prompts, "
        f"{OUTPUT_TOKENS} output tokens, greedy\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
