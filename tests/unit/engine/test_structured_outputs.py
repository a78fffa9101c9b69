"""Structured outputs through the Engine: every output validates, whatever the batch does.

A random-weight model makes this a strong test: without the grammar its output is never
valid (checked below), so a validating output is the grammar's doing. The tiny checkpoint's
tokenizer is a byte-level BPE (every byte is a token), so it can spell any JSON.

The settings of :data:`BUSY` make one batch do everything at once: chunked prefill (prompts
longer than the step budget), mixed steps (decode rows beside prefill chunks), prefix-cache
hits (repeated prompts) and preemption (too few KV blocks for every sequence), with ``n > 1``.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import Engine, SamplingParams, StructuredOutputsParams
from pagedinfer.adapters.sampling import grammar as grammar_module
from pagedinfer.adapters.sampling.grammar import GrammarCompiler
from pagedinfer.errors import (
    InvalidRequestError,
    InvalidStructuredOutputError,
    MissingDependencyError,
)

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA: dict[str, Any] = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -5, "maximum": 5},
                "y": {"type": "integer", "exclusiveMinimum": 10, "maximum": 99},
            },
            "required": ["x"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
        "kind": {"enum": ["cat", "dog", 3]},
        "points": {
            "type": "array",
            "items": {"$ref": "#/$defs/point"},
            "minItems": 1,
            "maxItems": 2,
        },
        "ok": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 4},
        "meta": {
            "type": "object",
            "properties": {"n": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
            "required": ["n"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "kind", "points", "meta"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}(\.[A-Z])?"
CHOICES = ["yes", "no", "maybe not"]
# Lark (llguidance's dialect) and GBNF: a tiny arithmetic expression.
LARK = 'start: expr\nexpr: term (("+" | "-") term){0,2}\nterm: /[0-9]{1,2}/ | "(" expr ")"'
GBNF = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= [a-c] [0-9]'
LARK_RE = re.compile(r"[0-9()+\-]+")
GBNF_RE = re.compile(r"\([a-c][0-9](,[a-c][0-9]){0,2}\)")

BUSY: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "max_model_len": 192,
    "max_num_seqs": 6,
    "max_num_batched_tokens": 40,
    "num_kv_blocks": 12,
    "enforce_eager": True,
}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[Engine]:
    with Engine(checkpoint, **BUSY) as built:
        yield built


def constrained(constraint: StructuredOutputsParams, **kwargs: Any) -> SamplingParams:
    kwargs.setdefault("max_tokens", 120)
    return SamplingParams(structured_outputs=constraint, **kwargs)


def json_params(**kwargs: Any) -> SamplingParams:
    return constrained(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), **kwargs)


def prompts(count: int) -> list[list[int]]:
    """Prompts of 30..70 tokens (longer than the 40-token step: chunked), each twice (prefix
    hits)."""
    distinct = [[(7 * i + 13 * j) % 500 + 1 for j in range(30 + 10 * i)] for i in range(count)]
    return [p for prompt in distinct for p in (prompt, prompt)]


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "lark":
        assert LARK_RE.fullmatch(text) and text.count("(") == text.count(")"), text
    else:
        assert GBNF_RE.fullmatch(text), text


KINDS: dict[str, StructuredOutputsParams] = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "lark": StructuredOutputsParams(grammar=LARK),
    "gbnf": StructuredOutputsParams(grammar=GBNF),
}


def test_every_output_validates_in_a_busy_batch(engine: Engine) -> None:
    """Each kind, greedy and sampled (n = 2), in one batch that chunks, mixes, hits the prefix
    cache and preempts: every completion ends on EOS and validates."""
    batch = prompts(5)
    kinds = [list(KINDS)[i % len(KINDS)] for i in range(len(batch))]
    params = [
        constrained(KINDS[kind], temperature=0.0)
        if i % 2
        else constrained(KINDS[kind], temperature=1.0, seed=i, n=2)
        for i, kind in enumerate(kinds)
    ]
    before = engine.stats().num_preemptions
    outputs = engine.generate(batch, params, use_tqdm=False)
    stats = engine.stats()
    assert stats.num_preemptions > before, "the batch should preempt"
    assert stats.prefix_cache_hit_rate > 0
    for kind, output in zip(kinds, outputs, strict=True):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", (kind, completion.text)
            assert completion.token_ids[-1] == 0  # the tokenizer's EOS
            check(kind, completion.text)


def test_without_the_grammar_the_outputs_are_not_valid(engine: Engine) -> None:
    """What makes the test above strong: the same model, unconstrained, never validates."""
    batch = prompts(3)
    outputs = engine.generate(batch, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    for output in outputs:
        text = output.outputs[0].text
        for kind in KINDS:
            with pytest.raises((AssertionError, ValueError, jsonschema.ValidationError)):
                check(kind, text)


def test_unconstrained_rows_are_exactly_their_solo_outputs(engine: Engine) -> None:
    """A mixed batch gives greedy and seeded unconstrained rows their tokens alone."""
    batch = prompts(3)
    free = [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.9, seed=5, max_tokens=24, top_p=0.9),
    ]
    solo = [engine.generate([batch[0]], [p], use_tqdm=False)[0] for p in free]
    mixed_params = [free[0], json_params(), free[1], json_params(temperature=1.0, seed=2)]
    mixed = engine.generate([batch[0], batch[2], batch[0], batch[4]], mixed_params, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == solo[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == solo[1].outputs[0].token_ids
    for output in (mixed[1], mixed[3]):
        check("json", output.outputs[0].text)


def test_max_tokens_cuts_with_length_and_stop_strings_stop(engine: Engine) -> None:
    cut = engine.generate([prompts(1)[0]], json_params(max_tokens=5), use_tqdm=False)[0]
    completion = cut.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5
    assert completion.text == '{"id"'  # a prefix of a valid output, one byte a token
    stopped = engine.generate([prompts(1)[0]], json_params(stop=['"kind"']), use_tqdm=False)[0]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == '"kind"'
    assert stopped.outputs[0].text.startswith('{"id":"') and '"kind"' not in stopped.outputs[0].text


def test_logprobs_are_of_the_masked_distribution(engine: Engine) -> None:
    """Logprobs of a constrained row are the model's with the grammar's mask applied (vLLM's
    order): forbidden tokens have -inf, the allowed ones share all the probability."""
    output = engine.generate(
        [prompts(1)[0]],
        constrained(KINDS["choice"], temperature=0.0, logprobs=5),
        use_tqdm=False,
    )[0]
    first = output.outputs[0].logprobs[0]
    finite = {token: entry.logprob for token, entry in first.items() if entry.logprob > -1e30}
    tokenizer = engine.tokenizer
    # Only first tokens of a choice are allowed at step 0 ("yes", "no", "maybe not").
    assert all(
        c.startswith(tokenizer.decode([t])) for t in finite for c in [_choice_of(t, tokenizer)]
    )
    import math

    assert math.fsum(math.exp(v) for v in finite.values()) == pytest.approx(1.0, abs=1e-4)
    assert len(finite) < len(first)  # some of the top-5 are forbidden: -inf


def _choice_of(token: int, tokenizer: Any) -> str:
    text = tokenizer.decode([token])
    matches = [c for c in CHOICES if c.startswith(text)]
    assert matches, f"token {token} ({text!r}) starts no choice"
    return matches[0]


def test_a_constraint_that_does_not_compile_is_refused_at_submission(engine: Engine) -> None:
    bad = [
        (StructuredOutputsParams(regex="a(b"), "regex does not compile: .*unclosed group"),
        (StructuredOutputsParams(json={"type": "strin"}), "json does not compile: .*strin"),
        (
            StructuredOutputsParams(json={"properties": {"a": {"$ref": "#/$defs/no"}}}),
            "json does not compile: .*defs/no",
        ),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar does not compile"),
        (StructuredOutputsParams(grammar="root ::= ("), "grammar"),
    ]
    for constraint, message in bad:
        with pytest.raises(InvalidStructuredOutputError, match=f"(?s){message}"):
            engine.generate(["x"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
        with pytest.raises(InvalidStructuredOutputError):
            engine.add_request("x", SamplingParams(structured_outputs=constraint))
    assert not engine.has_unfinished_requests()
    assert engine.generate(["x"], json_params(), use_tqdm=False)[0].finished  # still serving


def test_grammars_compile_once_in_the_submitting_thread(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled in the caller's thread without the engine's lock, once per key: the step
    loop (which installs the matchers) only reads the cache."""
    seen: list[tuple[str, bool]] = []
    original = GrammarCompiler._compile

    def recording(self: GrammarCompiler, params: StructuredOutputsParams) -> Any:
        seen.append((threading.current_thread().name, engine._lock.locked()))
        return original(self, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", recording)
    with Engine(checkpoint, **BUSY) as engine:
        same = [json_params(), json_params(temperature=1.0, seed=1, n=2)]
        outputs = engine.generate(prompts(1), same, use_tqdm=False)
        assert all(c.finish_reason == "stop" for o in outputs for c in o.outputs)
        assert seen == [(threading.current_thread().name, False)]
        assert engine._grammars.num_compiled == 1


def test_the_cache_is_bounded_and_recompiles_what_it_dropped(checkpoint: Path) -> None:
    compiler = GrammarCompiler(_tokenizer(checkpoint), 512, [0], cache_size=2)
    regexes = [StructuredOutputsParams(regex=f"a{{{i}}}") for i in range(1, 4)]
    for constraint in regexes:
        compiler.compile(constraint)
    assert compiler.num_compiled == 3
    compiler.compile(regexes[2])  # kept
    assert compiler.num_compiled == 3
    compiler.compile(regexes[0])  # dropped (least recently used): compiled again
    assert compiler.num_compiled == 4


def test_engines_that_cannot_constrain_say_why(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    constraint = StructuredOutputsParams(regex="a+")
    with pytest.raises(InvalidRequestError, match="need the model's tokenizer"):
        GrammarCompiler(None, 512, [0]).compile(constraint)
    with pytest.raises(InvalidRequestError, match="need an EOS token"):
        GrammarCompiler(_tokenizer(checkpoint), 512, []).compile(constraint)
    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)
    with pytest.raises(
        MissingDependencyError, match=r"pip install '\.\[structured\]' in the pagedinfer checkout"
    ):
        grammar_module.grammar_text(constraint)


def _tokenizer(checkpoint: Path) -> Any:
    from pagedinfer.engine.tokenizer import load_tokenizer

    return load_tokenizer(str(checkpoint))


def test_the_json_knobs_shape_the_output(engine: Engine) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
    }
    compact = engine.generate(
        [prompts(1)[0]] * 2,
        [
            constrained(
                StructuredOutputsParams(
                    json=schema, disable_any_whitespace=True, disable_additional_properties=True
                ),
                temperature=1.0,
                seed=seed,
            )
            for seed in range(2)
        ],
        use_tqdm=False,
    )
    for output in compact:
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop"
        assert re.fullmatch(r'\{"a":[0-9]\}', text), text  # no space, no other property
    any_object = engine.generate(
        [prompts(1)[0]],
        constrained(StructuredOutputsParams(json_object=True), temperature=0.0, max_tokens=200),
        use_tqdm=False,
    )[0].outputs[0]
    if any_object.finish_reason == "stop":
        assert isinstance(json.loads(any_object.text), dict)
    else:
        assert any_object.text.lstrip().startswith("{")


SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "k": {"enum": ["a", "b"]},
        "v": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 2,
        },
    },
    "required": ["k", "v"],
    "additionalProperties": False,
}


def _small_json(**kwargs: Any) -> SamplingParams:
    constraint = StructuredOutputsParams(json=SMALL_SCHEMA, disable_any_whitespace=True)
    return constrained(constraint, max_tokens=60, **kwargs)


@pytest.mark.skipif(
    __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton backend on the CPU needs TRITON_INTERPRET=1",
)
def test_outputs_validate_on_the_triton_backend(checkpoint: Path) -> None:
    """The interpreter is slow: two requests, one of them forking (n = 2), one chunked."""
    with Engine(
        checkpoint, **{**BUSY, "attention_backend": "triton", "num_kv_blocks": 32}
    ) as engine:
        outputs = engine.generate(
            prompts(2)[::2],
            [_small_json(temperature=0.0), _small_json(temperature=1.0, seed=3, n=2)],
            use_tqdm=False,
        )
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), SMALL_SCHEMA)
