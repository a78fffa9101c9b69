"""Structured outputs on a real GPU (issue 37): the grammar's token bitmask applied on CUDA,
to decode steps a CUDA graph replays and to eager ones, and every output valid.

A random-weight model never writes valid JSON by chance, so a valid output is the mask's
doing. The bitmask is filled on the host while the forward runs and copied to the device
without a wait; the logits are masked after the graph's replay (the mask is outside the
graph) or after the eager forward. Needs llguidance: on a machine without network,
``make test-gpu`` installs it from ``tests/gpu/wheels/`` first (docs/testing.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer import Engine, SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "n", "ok"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
OPTIONS: dict[str, Any] = {
    "device": "cuda",
    "dtype": "float32",
    "kv_block_size": 16,
    "max_model_len": 256,
    "num_kv_blocks": 64,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 8,
}


def _requests() -> tuple[list[str], list[SamplingParams]]:
    prompts, params = [], []
    for index in range(8):
        if index % 2:
            constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        else:
            constraint = StructuredOutputsParams(regex=REGEX)
        prompts.append(f"request {index}: " + "x" * (5 * index))
        params.append(
            SamplingParams(
                temperature=0.0 if index % 3 else 0.9,
                seed=index,
                max_tokens=80,
                structured_outputs=constraint,
            )
        )
    return prompts, params


def _check(texts: list[str]) -> None:
    for index, text in enumerate(texts):
        if index % 2:
            value = json.loads(text)
            assert set(value) == {"id", "n", "ok"}, text
            assert re.fullmatch("[a-z]{2}[0-9]{2}", value["id"]), text
            assert 0 <= value["n"] <= 99 and isinstance(value["ok"], bool), text
        else:
            assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_structured_outputs_on_cuda(make_checkpoint: Callable[..., Path], graphs: bool) -> None:
    checkpoint = make_checkpoint("tiny", with_tokenizer=True)
    prompts, params = _requests()
    with Engine(checkpoint, enforce_eager=not graphs, **OPTIONS) as engine:
        runner = engine._executor
        assert (getattr(runner, "graph_runner", None) is not None) == graphs
        outputs = engine.generate(prompts, params)
        _check([output.outputs[0].text for output in outputs])
        # Greedy rows are reproducible: a second run gives the same texts.
        again = engine.generate(prompts, params)
        assert [o.outputs[0].text for o in again] == [o.outputs[0].text for o in outputs]
