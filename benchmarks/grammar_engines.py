"""xgrammar against llguidance on pagedinfer's structured-output workload (one run, one table).

For each engine that imports, and each tokenizer (``--vocab``: byte-level BPE tokenizers built
like the test checkpoints', 512 ids and Qwen3's 151,936 ids):

* **tokenizer**: the one-time set-up from the Hugging Face tokenizer (ms);
* **compile**: each schema of :data:`SCHEMAS`, cold (a new compiler, no cache) and again from
  the engine's own cache where it has one (ms);
* **mask**: the host time to fill one row's bitmask, per token, while a matcher walks a valid
  output token by token (µs, median and p99), and a batch of 64 such rows per step;
* **coverage**: for each JSON-schema feature of :data:`FEATURES`, whether it compiles and
  whether 20 random walks under the mask (a uniformly random allowed token each step, EOS when
  allowed with probability 1/4) all end complete and validate with ``jsonschema``.

Runs from a plain checkout; engines that are not installed are skipped (xgrammar is not a
dependency: ``pip install xgrammar`` for a comparison)::

    PYTHONPATH=src python3 benchmarks/grammar_engines.py [--vocab 512 151936]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch

DEFS_SCHEMA: dict[str, Any] = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
        }
    },
    "type": "object",
    "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/point"}}},
    "required": ["points"],
}
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city"],
        },
    },
    "required": ["name", "arguments"],
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "object": {"type": "object"},
    "tool call": TOOL_SCHEMA,
    "$defs": DEFS_SCHEMA,
}
_OBJ = {"type": "object", "additionalProperties": False}
FEATURES: dict[str, dict[str, Any]] = {
    "nested objects": {
        **_OBJ,
        "properties": {
            "a": {**_OBJ, "properties": {"b": {**_OBJ, "properties": {"c": {"type": "boolean"}}}}}
        },
        "required": ["a"],
    },
    "array min/maxItems": {
        **_OBJ,
        "properties": {
            "v": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3}
        },
        "required": ["v"],
    },
    "enum": {**_OBJ, "properties": {"e": {"enum": ["x", 2, None]}}, "required": ["e"]},
    "integer range": {
        **_OBJ,
        "properties": {"i": {"type": "integer", "minimum": -20, "maximum": 35}},
        "required": ["i"],
    },
    "number range": {
        **_OBJ,
        "properties": {"n": {"type": "number", "exclusiveMinimum": 0.5, "maximum": 2.5}},
        "required": ["n"],
    },
    "string pattern": {
        **_OBJ,
        "properties": {"s": {"type": "string", "pattern": "^[a-c]{2}-[0-9]{1,3}$"}},
        "required": ["s"],
    },
    "string min/maxLength": {
        **_OBJ,
        "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["s"],
    },
    "required/optional": {
        **_OBJ,
        "properties": {"r": {"type": "boolean"}, "o": {"type": "boolean"}},
        "required": ["r"],
    },
    "$ref/$defs": {
        "$defs": {"leaf": {"type": "integer", "minimum": 0, "maximum": 9}},
        **_OBJ,
        "properties": {"l": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 3}},
        "required": ["l"],
    },
    "anyOf": {
        **_OBJ,
        "properties": {
            "u": {"anyOf": [{"type": "boolean"}, {"type": "integer", "maximum": 9, "minimum": 0}]}
        },
        "required": ["u"],
    },
    "const": {**_OBJ, "properties": {"c": {"const": "fixed"}}, "required": ["c"]},
    "format date": {
        **_OBJ,
        "properties": {"d": {"type": "string", "format": "date"}},
        "required": ["d"],
    },
}


# ------------------------------------------------------------------ engines
class Engine:
    """One grammar engine behind a small common interface."""

    name = ""

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        raise NotImplementedError

    def compile(self, schema: dict[str, Any]) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        raise NotImplementedError

    def accept(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError


class Guidance(Engine):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        import llguidance

        self.llg = llguidance
        backend = tokenizer.backend_tokenizer
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=[eos])

    def compile(self, schema: dict[str, Any]) -> Any:
        text = self.llg.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False}
        )
        matcher = self.llg.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask.shape[1]
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * words * 4, words * 4)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=[eos]
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


ENGINES: dict[str, Callable[[Any, int, int], Engine]] = {
    "llguidance": Guidance,
    "xgrammar": XGrammar,
}


# ---------------------------------------------------------------- measuring
def allowed_ids(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    words = bitmask[row]
    bits = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


def random_walk(
    engine: Engine, compiled: Any, vocab: int, eos: int, rng: random.Random, limit: int = 300
) -> list[int] | None:
    """Tokens of one random output under the mask (EOS excluded), or None if cut at ``limit``."""
    matcher = engine.matcher(compiled)
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    tokens: list[int] = []
    for _ in range(limit):
        engine.fill(matcher, bitmask, 0)
        allowed = allowed_ids(bitmask, 0, vocab)
        if eos in allowed and (len(allowed) == 1 or rng.random() < 0.25):
            return tokens
        choices = [t for t in allowed if t != eos]
        token = rng.choice(choices)
        assert engine.accept(matcher, token)
        tokens.append(token)
    return None


def mask_times(engine: Engine, compiled: Any, vocab: int, eos: int, rows: int) -> list[float]:
    """Seconds per step to fill ``rows`` rows while ``rows`` matchers walk random outputs."""
    rng = random.Random(0)
    matchers = [engine.matcher(compiled) for _ in range(rows)]
    bitmask = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)
    times: list[float] = []
    for _ in range(60):
        started = time.perf_counter()
        for row, matcher in enumerate(matchers):
            engine.fill(matcher, bitmask, row)
        times.append(time.perf_counter() - started)
        for row, matcher in enumerate(matchers):
            allowed = [t for t in allowed_ids(bitmask, row, vocab) if t != eos]
            if not allowed:
                return times
            engine.accept(matcher, rng.choice(allowed))
    return times


def run(vocab: int, tokenizer: Any, eos: int) -> list[str]:
    import jsonschema

    lines = [f"### vocabulary {vocab}", ""]
    rows: dict[str, dict[str, str]] = {}
    coverage: dict[str, dict[str, str]] = {}
    for name, factory in ENGINES.items():
        try:
            started = time.perf_counter()
            engine = factory(tokenizer, vocab, eos)
            setup = time.perf_counter() - started
        except ImportError:
            print(f"{name}: not installed, skipped", file=sys.stderr)
            continue
        result = rows.setdefault(name, {})
        result["tokenizer set-up (ms)"] = f"{setup * 1e3:.0f}"
        for label, schema in SCHEMAS.items():
            cold_engine = factory(tokenizer, vocab, eos)
            started = time.perf_counter()
            compiled = cold_engine.compile(schema)
            cold = time.perf_counter() - started
            started = time.perf_counter()
            cold_engine.compile(schema)
            warm = time.perf_counter() - started
            result[f"compile {label}: cold / 2nd (ms)"] = f"{cold * 1e3:.1f} / {warm * 1e3:.2f}"
        compiled = engine.compile(TOOL_SCHEMA)
        one = mask_times(engine, compiled, vocab, eos, 1)
        p99 = sorted(one)[int(0.99 * (len(one) - 1))]
        result["mask, 1 row (µs/token, median / p99)"] = (
            f"{statistics.median(one) * 1e6:.0f} / {p99 * 1e6:.0f}"
        )
        batch = mask_times(engine, compiled, vocab, eos, 64)
        result["mask, 64 rows (ms/step, median)"] = f"{statistics.median(batch) * 1e3:.2f}"
        for feature, schema in FEATURES.items():
            try:
                feature_compiled = engine.compile(schema)
            except Exception as error:  # an engine's refusal is a result here
                coverage.setdefault(feature, {})[name] = f"refused ({str(error)[:40]}...)"
                continue
            rng = random.Random(1)
            valid = 0
            for _ in range(20):
                tokens = random_walk(engine, feature_compiled, vocab, eos, rng)
                if tokens is None:
                    continue
                try:
                    jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
            coverage.setdefault(feature, {})[name] = f"{valid}/20 valid"
    names = list(rows)
    lines += ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key in next(iter(rows.values()), {}):
        lines.append(f"| {key} | " + " | ".join(rows[n][key] for n in names) + " |")
    lines += ["", "| feature | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for feature, results in coverage.items():
        lines.append(f"| {feature} | " + " | ".join(results.get(n, "-") for n in names) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[512, 151936])
    parser.add_argument("--tokenizer-cache", default="/tmp/pagedinfer-bench-tokenizers")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from pagedinfer.adapters.models.random_checkpoint import build_tokenizer

    lines: list[str] = []
    for vocab in args.vocab:
        cached = Path(args.tokenizer_cache) / str(vocab)
        if not (cached / "tokenizer.json").exists():
            build_tokenizer(vocab).save_pretrained(str(cached))  # minutes at 151,936
        tokenizer = AutoTokenizer.from_pretrained(str(cached))
        lines += run(vocab, tokenizer, tokenizer.eos_token_id)
        lines.append("")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
