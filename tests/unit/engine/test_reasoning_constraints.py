"""Constraints that start after a thinking model's reasoning (``reasoning_end``), through the
Engine, on a random model whose vocabulary has ``<think>`` and ``</think>`` as tokens.

``logit_bias`` scripts the reasoning: a huge bias on a word makes the model think in that
word, one on ``</think>`` ends the reasoning. Random weights never write valid JSON by
themselves, so a valid answer is the grammar's doing, and a word that is no JSON before the
end token shows that the reasoning is left unconstrained.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import Engine, SamplingParams, StructuredOutputsParams
from pagedinfer.domain.reasoning import ReasoningEnd
from pagedinfer.errors import InvalidStructuredOutputError

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
KWARGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "num_kv_blocks": 64,
    "max_model_len": 256,
    "enforce_eager": True,
}


@pytest.fixture(scope="module")
def engine(thinking_checkpoint: Path) -> Iterator[Engine]:
    with Engine(thinking_checkpoint, **KWARGS) as built:
        yield built


def _ids(engine: Engine) -> tuple[int, int]:
    """The ids of ``</think>`` and of a word that is no JSON (``Hello``)."""
    tokenizer = engine.tokenizer
    end = tokenizer.convert_tokens_to_ids("</think>")
    (word,) = tokenizer.encode("Hello")[:1]
    return end, word


def _constraint(end: int | None, **knobs: Any) -> StructuredOutputsParams:
    reasoning_end = None if end is None else ReasoningEnd([end])
    return StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True, reasoning_end=reasoning_end, **knobs
    )


def test_the_grammar_starts_after_the_end_token(engine: Engine) -> None:
    end, _ = _ids(engine)
    params = SamplingParams(
        temperature=0,
        max_tokens=40,
        logit_bias={end: 100.0},
        structured_outputs=_constraint(end),
    )
    (completion,) = engine.generate("Think, then answer.", params, use_tqdm=False)[0].outputs
    assert completion.token_ids[0] == end  # allowed although no JSON starts with it
    reasoning, _, answer = completion.text.partition("</think>")
    assert reasoning == ""
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert completion.finish_reason == "stop"


def test_without_a_reasoning_end_the_end_token_is_masked(engine: Engine) -> None:
    end, _ = _ids(engine)
    params = SamplingParams(
        temperature=0, max_tokens=40, logit_bias={end: 100.0}, structured_outputs=_constraint(None)
    )
    (completion,) = engine.generate("Answer.", params, use_tqdm=False)[0].outputs
    assert end not in completion.token_ids
    jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_the_reasoning_is_unconstrained_until_it_ends(engine: Engine) -> None:
    end, word = _ids(engine)
    params = SamplingParams(
        temperature=0,
        max_tokens=6,
        logit_bias={word: 100.0},
        structured_outputs=_constraint(end),
    )
    (completion,) = engine.generate("Think.", params, use_tqdm=False)[0].outputs
    assert completion.token_ids == [word] * 6  # no JSON, and never ended: never constrained
    assert completion.finish_reason == "length"


def test_sampled_reasoning_then_a_valid_answer_in_every_completion(engine: Engine) -> None:
    """Seeded sampling between the word and the end token: each completion thinks in the
    word for a while (or not at all), then answers under the schema."""
    end, word = _ids(engine)
    params = SamplingParams(
        n=8,
        seed=7,
        max_tokens=60,
        logit_bias={word: 12.0, end: 10.0},
        structured_outputs=_constraint(end),
    )
    outputs = engine.generate("Think, then answer.", params, use_tqdm=False)[0].outputs
    thought = 0
    for completion in outputs:
        assert end in completion.token_ids, completion.text
        cut = completion.token_ids.index(end)
        assert set(completion.token_ids[:cut]) <= {word}
        thought += cut
        jsonschema.validate(json.loads(completion.text.partition("</think>")[2]), SCHEMA)
    assert thought > 0  # some reasoning happened before some answer


def test_a_reasoning_end_is_token_ids() -> None:
    assert ReasoningEnd([3, 4]).token_ids == (3, 4)
    for bad in ([], [-1], "</think>", [1.5], [True], None):
        with pytest.raises(InvalidStructuredOutputError, match=r"ReasoningEnd\.token_ids"):
            ReasoningEnd(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidStructuredOutputError, match="reasoning_end"):
        StructuredOutputsParams(json_object=True, reasoning_end=(3,))  # type: ignore[arg-type]
    gated = _constraint(3)
    assert gated.cache_key == _constraint(None).cache_key  # the same grammar
    assert "reasoning_end" in repr(gated)
    assert pickle.loads(pickle.dumps(gated)) == gated  # to a Ray worker


def test_gated_constraints_in_a_busy_batch(thinking_checkpoint: Path) -> None:
    """Gated and ungated constraints in one batch that chunks its prompts and preempts:
    each completion reasons (unconstrained) until its end token, then answers under the
    schema; the ungated ones never write the end token."""
    from tests.unit.engine.test_structured_outputs import BUSY

    with Engine(thinking_checkpoint, **BUSY) as busy:
        end, word = _ids(busy)
        prompt = " ".join(["Think about paged attention, then answer."] * 6)
        gated = SamplingParams(
            n=3,
            seed=11,
            max_tokens=60,
            logit_bias={word: 12.0, end: 10.0},
            structured_outputs=_constraint(end),
        )
        plain = SamplingParams(
            n=2, seed=5, max_tokens=60, logit_bias={end: 20.0}, structured_outputs=_constraint(None)
        )
        before = busy.stats().num_preemptions
        outputs = busy.generate([prompt, prompt, prompt], [gated, plain, gated], use_tqdm=False)
        assert busy.stats().num_preemptions > before, "the batch should preempt"
    for output, params in zip(outputs, [gated, plain, gated], strict=True):
        for completion in output.outputs:
            if params is plain:
                assert end not in completion.token_ids
                jsonschema.validate(json.loads(completion.text), SCHEMA)
                continue
            cut = completion.token_ids.index(end)
            assert set(completion.token_ids[:cut]) <= {word}
            jsonschema.validate(json.loads(completion.text.partition("</think>")[2]), SCHEMA)
