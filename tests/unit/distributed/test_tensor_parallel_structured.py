"""Structured outputs with ``tensor_parallel_size=2`` on the CPU (gloo): rank 0 samples and
owns the grammar matchers; the worker never sees a grammar."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import Engine, SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

pytestmark = [pytest.mark.tensor_parallel, pytest.mark.slow]

# Chunked prefill, mixed steps, prefix hits and preemption, as in
# tests/unit/engine/test_structured_outputs.py.
BUSY: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "max_model_len": 192,
    "max_num_seqs": 6,
    "max_num_batched_tokens": 40,
    "num_kv_blocks": 12,
    "enforce_eager": True,
}
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
    return SamplingParams(structured_outputs=constraint, max_tokens=60, **kwargs)


def prompts(count: int) -> list[list[int]]:
    distinct = [[(7 * i + 13 * j) % 500 + 1 for j in range(30 + 10 * i)] for i in range(count)]
    return [p for prompt in distinct for p in (prompt, prompt)]


def test_outputs_validate_with_tensor_parallelism(make_checkpoint: Callable[..., Path]) -> None:
    checkpoint = make_checkpoint("tiny", with_tokenizer=True)
    """TP = 2 on the CPU (gloo): rank 0 samples and owns the matchers; the worker never sees
    a grammar. Greedy outputs equal the single-process engine's."""
    batch = prompts(3)
    params = [_small_json(temperature=0.0), _small_json(temperature=1.0, seed=4, n=2)] * 3
    with Engine(checkpoint, **{**BUSY, "tensor_parallel_size": 2}) as engine:
        parallel = engine.generate(batch, params, use_tqdm=False)
    for output in parallel:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), SMALL_SCHEMA)
    with Engine(checkpoint, **BUSY) as engine:
        single = engine.generate(batch[::2], params[::2], use_tqdm=False)
    assert [o.outputs[0].text for o in single] == [o.outputs[0].text for o in parallel[::2]]
