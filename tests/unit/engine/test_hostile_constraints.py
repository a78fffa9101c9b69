"""Hostile and unlucky structured-output constraints fail only their own request.

At submission, what can be refused is (``InvalidStructuredOutputError``, a 400 through the
server): lexer blow-ups found by the probe, empty languages, too-deep or too-big schemas; the
same constraint again gets the same refusal from a cache. What slips through fails at run time
with ``finish_reason="error"`` and a reason, and every other request of the batch finishes as
it would alone. The step loop never compiles: each request carries its compiled grammar.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import Engine, GrammarLimits, SamplingParams, StructuredOutputsParams
from pagedinfer.errors import ConfigurationError, InvalidStructuredOutputError

pytest.importorskip("llguidance")

SETTINGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "max_model_len": 128,
    "max_num_seqs": 8,
    "num_kv_blocks": 48,
    "enforce_eager": True,
}
PLAIN = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [[3, 14, 15, 92, 65], [35, 89, 79, 32]]


def nested_objects(depth: int) -> dict[str, Any]:
    """An object schema with ``depth`` objects nested (built without recursion)."""
    root: dict[str, Any] = {"type": "object"}
    current = root
    for _ in range(depth):
        child: dict[str, Any] = {"type": "object"}
        current["properties"] = {"a": child}
        current["required"] = ["a"]
        current = child
    return root


def nested_objects_text(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + "{}" + "}}" * depth


TOOL_SCHEMA = {
    "type": "object",
    "properties": {"p": {"type": "string", "pattern": "^d{1000000}$"}},
    "required": ["p"],
    "additionalProperties": False,
}

HOSTILE: dict[str, Callable[[], StructuredOutputsParams]] = {
    "huge repetition": lambda: StructuredOutputsParams(regex="a{1000000}"),
    "nested repetition": lambda: StructuredOutputsParams(regex="((a{100}){100}){100}"),
    "lark terminal": lambda: StructuredOutputsParams(grammar="start: /c{1000000}/"),
    "tool parameter pattern": lambda: StructuredOutputsParams(json=TOOL_SCHEMA),
    "empty regex": lambda: StructuredOutputsParams(regex=r"[^\s\S]"),
    "self reference": lambda: StructuredOutputsParams(json={"$ref": "#"}),
    "300-deep closed objects": lambda: StructuredOutputsParams(
        json=nested_objects(300), disable_additional_properties=True
    ),
    "600-deep JSON text": lambda: StructuredOutputsParams(json=nested_objects_text(600)),
    "100-deep objects": lambda: StructuredOutputsParams(json=nested_objects(100)),
}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[Engine]:
    with Engine(checkpoint, **SETTINGS) as built:
        yield built


def solo(engine: Engine, prompt: list[int]) -> list[int]:
    return engine.generate([prompt], PLAIN, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_constraints_are_refused_at_submission(engine: Engine, name: str) -> None:
    params = SamplingParams(max_tokens=5, structured_outputs=None)
    with pytest.raises(InvalidStructuredOutputError, match=r"StructuredOutputsParams\.") as info:
        constraint = HOSTILE[name]()
        params = SamplingParams(max_tokens=5, structured_outputs=constraint)
        engine.generate(["x"], params, use_tqdm=False)
    assert "Traceback" not in str(info.value)
    assert not engine.is_dead and not engine.has_unfinished_requests()


def test_a_2000_deep_schema_dict_is_a_typed_error_not_a_recursion_error() -> None:
    with pytest.raises(InvalidStructuredOutputError, match="nests deeper"):
        StructuredOutputsParams(json=nested_objects(2000))
    with pytest.raises(InvalidStructuredOutputError, match="nests deeper"):
        StructuredOutputsParams(json=nested_objects_text(2000))


def test_a_refusal_repeats_from_the_cache(engine: Engine) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="b{1000000}"))
    with pytest.raises(InvalidStructuredOutputError) as first:
        engine.check_sampling_params(params)
    refused = engine._grammars.num_refused
    with pytest.raises(InvalidStructuredOutputError) as again:
        engine.check_sampling_params(params)
    assert str(again.value) == str(first.value)
    assert engine._grammars.num_refused == refused  # not compiled nor probed again


def test_empty_languages_name_the_reason(engine: Engine) -> None:
    for constraint in (HOSTILE["empty regex"](), HOSTILE["self reference"]()):
        with pytest.raises(InvalidStructuredOutputError, match="accepts no string"):
            engine.check_sampling_params(SamplingParams(structured_outputs=constraint))


def test_the_size_limit_is_the_engines(checkpoint: Path) -> None:
    with Engine(checkpoint, grammar_limits=GrammarLimits(max_chars=10), **SETTINGS) as small:
        constraint = StructuredOutputsParams(regex="[a-z]{1,20}@example")
        with pytest.raises(InvalidStructuredOutputError, match="max_chars"):
            small.check_sampling_params(SamplingParams(structured_outputs=constraint))
    with pytest.raises(ConfigurationError, match="step_lexer_fuel"):
        GrammarLimits(step_lexer_fuel=0)


def test_a_grammar_failing_at_run_time_ends_only_its_request(checkpoint: Path) -> None:
    """Without the probe the blow-up comes at the first token: that request ends with
    "error" and a reason, its neighbours finish exactly as alone, the engine lives on."""
    limits = GrammarLimits(probe_tokens=0)
    with Engine(checkpoint, grammar_limits=limits, **SETTINGS) as engine:
        alone = [solo(engine, prompt) for prompt in PROMPT]
        for round_ in range(4):  # more than max_consecutive_failed_steps (3)
            hostile = SamplingParams(
                max_tokens=5,
                n=2,
                structured_outputs=StructuredOutputsParams(regex=f"{'xyz'[round_ % 3]}{{1000000}}"),
            )
            outputs = engine.generate(
                [PROMPT[0], "x", PROMPT[1]], [PLAIN, hostile, PLAIN], use_tqdm=False
            )
            assert [o.outputs[0].token_ids for o in (outputs[0], outputs[2])] == alone
            assert all(o.finish_reason == "length" for o in outputs[0].outputs + outputs[2].outputs)
            for completion in outputs[1].outputs:
                assert completion.finish_reason == "error"
                assert completion.error is not None and "constraint" in completion.error
                assert completion.token_ids == []
        assert not engine.is_dead
        ok = SamplingParams(
            max_tokens=6, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")
        )
        text = engine.generate(["x"], ok, use_tqdm=False)[0].outputs[0]
        assert text.finish_reason == "stop" and text.error is None
        assert len(text.text) == 3 and text.text.isdigit()


def test_the_step_loop_never_compiles(engine: Engine) -> None:
    """Distinct schemas, more than the cache holds: each request carries its grammar."""
    compiler = engine._grammars
    saved = compiler.cache_size
    compiler.cache_size = 1
    try:
        params = [
            SamplingParams(
                max_tokens=8,
                structured_outputs=StructuredOutputsParams(
                    json={
                        "type": "object",
                        "properties": {f"k{i}": {"type": "integer"}},
                        "required": [f"k{i}"],
                        "additionalProperties": False,
                    },
                    disable_any_whitespace=True,
                ),
            )
            for i in range(6)
        ]
        checked = [engine.check_sampling_params(p) for p in params]
        compiled = compiler.num_compiled
        outputs = engine.generate(["x"] * 6, checked, use_tqdm=False)
        assert compiler.num_compiled == compiled
        assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outputs)
    finally:
        compiler.cache_size = saved


def test_the_compiled_grammar_is_not_part_of_the_value() -> None:
    import pickle

    constraint = StructuredOutputsParams(regex="[0-9]+")
    pinned = constraint.with_compiled(object())
    assert pinned == constraint and hash(pinned) == hash(constraint)
    assert "compiled" not in repr(pinned)
    restored = pickle.loads(pickle.dumps(pinned))
    assert restored == constraint and restored.compiled is None


def test_a_grammar_from_another_engine_is_compiled_again(engine: Engine, checkpoint: Path) -> None:
    constraint = StructuredOutputsParams(regex="[a-c]{2}")
    checked = engine.check_sampling_params(SamplingParams(structured_outputs=constraint))
    assert checked.structured_outputs is not None
    assert engine._grammars.pinned(checked.structured_outputs) is not None
    with Engine(checkpoint, **SETTINGS) as other:
        again = other.check_sampling_params(checked)
        assert again.structured_outputs is not None
        assert other._grammars.pinned(again.structured_outputs) is not None
        assert other._grammars.pinned(checked.structured_outputs) is None
