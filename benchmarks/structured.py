"""Structured outputs: throughput with 0 %, 50 % and 100 % of requests JSON-schema constrained.

One run, side by side: ``--batch`` requests (64) of ``--prompt-len`` random tokens, each
generating exactly ``--max-tokens`` tokens at temperature 0.6 (seeded): unconstrained rows
with ``ignore_eos``, constrained rows under :data:`SCHEMA` (an array of at least 100 small
objects, which cannot be complete within ``--max-tokens``, so EOS is never allowed and every
row runs to ``max_tokens`` like the others). Reported per fraction: wall time, output
tokens/s and the ratio to the unconstrained run; the host time of the bitmask (fill) and of
its application on the device, per step; and the compile time of a few schemas (cold, then a
cache hit).

Model: ``--model DIR`` (a checkpoint with a tokenizer), or by default the ``small`` random
preset with a byte-level BPE tokenizer of ``--vocab`` ids built like the test checkpoints'::

    PYTHONPATH=src python3 benchmarks/structured.py [--device cpu] [--batch 64]

:func:`run_structured` and :func:`markdown` are what a report (``benchmarks/gpu_report.py``)
can call on a GPU.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from pagedinfer import Engine, SamplingParams, StructuredOutputsParams
from pagedinfer.adapters.sampling import grammar as grammar_module
from pagedinfer.adapters.sampling.grammar import GrammarCompiler

ITEM = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 100}
COMPILE_SCHEMAS: dict[str, dict[str, Any]] = {
    "object": {"type": "object"},
    "array of objects": SCHEMA,
    "$defs": {
        "$defs": {"item": ITEM},
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}}},
        "required": ["items"],
    },
}


@contextmanager
def timed_grammar() -> Iterator[dict[str, float]]:
    """Accumulate the host time of ``GrammarMatchers.fill`` and of ``apply_token_bitmask``
    (which also waits for the device on CUDA only at the step's end, so it is launch time)."""
    totals = {"fill_s": 0.0, "apply_s": 0.0, "steps": 0.0}
    fill, apply = grammar_module.GrammarMatchers.fill, grammar_module.apply_token_bitmask
    import pagedinfer.adapters.sampling.pipeline as pipeline_module

    def timed_fill(self: Any, slots: Any) -> Any:
        started = time.perf_counter()
        result = fill(self, slots)
        totals["fill_s"] += time.perf_counter() - started
        totals["steps"] += result is not None
        return result

    def timed_apply(logits: Any, step: Any) -> None:
        started = time.perf_counter()
        apply(logits, step)
        totals["apply_s"] += time.perf_counter() - started

    grammar_module.GrammarMatchers.fill = timed_fill  # type: ignore[method-assign]
    pipeline_module.apply_token_bitmask = timed_apply  # type: ignore[attr-defined]
    try:
        yield totals
    finally:
        grammar_module.GrammarMatchers.fill = fill  # type: ignore[method-assign]
        pipeline_module.apply_token_bitmask = apply  # type: ignore[attr-defined]


def run_structured(
    model: str,
    *,
    device: str = "cpu",
    batch: int = 64,
    prompt_len: int = 32,
    max_tokens: int = 128,
    fractions: tuple[float, ...] = (0.0, 0.5, 1.0),
    rounds: int = 2,
    engine_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the workload at each constrained fraction on one engine; the numbers as a dict.

    The fractions run in turn, ``rounds`` times over (interleaved, so that a busy machine
    slows each alike); each fraction reports its fastest round."""
    rng = random.Random(0)
    kwargs = {
        "device": device,
        "max_model_len": prompt_len + max_tokens + 16,
        **(engine_kwargs or {}),
    }
    results: dict[str, Any] = {"runs": [], "compile": []}
    with Engine(model, **kwargs) as engine:
        vocab = engine.model_config.vocab_size
        prompts = [
            [rng.randrange(1, min(vocab, 10_000)) for _ in range(prompt_len)] for _ in range(batch)
        ]
        constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        engine.check_sampling_params(SamplingParams(structured_outputs=constraint))  # compile
        warm_up = SamplingParams(max_tokens=8, ignore_eos=True)
        engine.generate(prompts, warm_up, use_tqdm=False)
        best: dict[float, dict[str, float]] = {}
        for fraction in [f for _ in range(rounds) for f in fractions]:
            constrained = round(batch * fraction)
            params = [
                SamplingParams(
                    temperature=0.6,
                    seed=i,
                    max_tokens=max_tokens,
                    ignore_eos=i >= constrained,
                    structured_outputs=constraint if i < constrained else None,
                )
                for i in range(batch)
            ]
            with timed_grammar() as grammar:
                started = time.perf_counter()
                outputs = engine.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - started
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
            steps = max(grammar["steps"], 1.0)
            if fraction in best and best[fraction]["seconds"] <= seconds:
                continue
            best[fraction] = {
                "constrained": fraction,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "fill_ms_per_step": grammar["fill_s"] / steps * 1e3,
                "apply_ms_per_step": grammar["apply_s"] / steps * 1e3,
                "grammar_share": (grammar["fill_s"] + grammar["apply_s"]) / seconds,
            }
        results["runs"] = [best[fraction] for fraction in fractions]
        tokenizer, eos = engine.tokenizer, engine.model_config.eos_token_ids
    for label, schema in COMPILE_SCHEMAS.items():
        compiler = GrammarCompiler(tokenizer, vocab, eos)
        compiler.compile(StructuredOutputsParams(regex="a"))  # the tokenizer's one-time set-up
        params = StructuredOutputsParams(json=schema)
        started = time.perf_counter()
        compiler.compile(params)
        cold = time.perf_counter() - started
        started = time.perf_counter()
        compiler.compile(params)
        hit = time.perf_counter() - started
        results["compile"].append({"schema": label, "cold_ms": cold * 1e3, "hit_ms": hit * 1e3})
    return results


def markdown(results: dict[str, Any]) -> str:
    runs = results["runs"]
    base = runs[0]["tokens_per_s"]
    lines = [
        "| constrained | wall (s) | output tok/s | vs 0 % | mask fill (ms/step) "
        "| mask apply (ms/step) | grammar share of wall |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        lines.append(
            f"| {run['constrained']:.0%} | {run['seconds']:.2f} | {run['tokens_per_s']:.0f} "
            f"| {run['tokens_per_s'] / base:.3f} | {run['fill_ms_per_step']:.2f} "
            f"| {run['apply_ms_per_step']:.2f} | {run['grammar_share']:.1%} |"
        )
    lines += ["", "| schema | compile, cold (ms) | cache hit (ms) |", "|---|---|---|"]
    for item in results["compile"]:
        lines.append(f"| {item['schema']} | {item['cold_ms']:.1f} | {item['hit_ms']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint directory with a tokenizer")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096, help="the random model's vocabulary")
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

        model = str(
            build_random_checkpoint(
                tempfile.mkdtemp(prefix="pagedinfer-structured-"),
                "small",
                with_tokenizer=True,
                vocab_size=args.vocab,
            )
        )
    results = run_structured(
        model,
        device=args.device,
        batch=args.batch,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        engine_kwargs={"num_threads": args.num_threads, "max_num_seqs": args.batch},
    )
    print(markdown(results))


if __name__ == "__main__":
    main()
