"""Constraints gated by a thinking model's reasoning end (``reasoning_end``) on a real GPU:
the all-ones rows of the reasoning and the grammar's rows after ``</think>`` go through the
pinned bitmask to CUDA, after a graph replay and after an eager forward.

``logit_bias`` scripts the reasoning on the random model (``thinking_checkpoint``): it thinks
in one word, then writes ``</think>``; the answer after it must match the schema.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer import Engine, SamplingParams, StructuredOutputsParams
from pagedinfer.domain.reasoning import ReasoningEnd

pytest.importorskip("llguidance")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
OPTIONS: dict[str, Any] = {
    "device": "cuda",
    "dtype": "float32",
    "kv_block_size": 16,
    "max_model_len": 256,
    "num_kv_blocks": 64,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 8,
}


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_gated_constraints_on_cuda(thinking_checkpoint: Path, graphs: bool) -> None:
    with Engine(thinking_checkpoint, enforce_eager=not graphs, **OPTIONS) as engine:
        end = engine.tokenizer.convert_tokens_to_ids("</think>")
        word = engine.tokenizer.encode("Hello")[0]
        constraint = StructuredOutputsParams(
            json=SCHEMA, disable_any_whitespace=True, reasoning_end=ReasoningEnd([end])
        )
        params = SamplingParams(
            n=8,
            seed=3,
            max_tokens=60,
            logit_bias={word: 12.0, end: 10.0},
            structured_outputs=constraint,
        )
        (output,) = engine.generate(["Think, then answer."], params, use_tqdm=False)
    thought = 0
    for completion in output.outputs:
        cut = completion.token_ids.index(end)
        assert set(completion.token_ids[:cut]) <= {word}, completion.text
        thought += cut
        value = json.loads(completion.text.partition("</think>")[2])
        assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 9, completion.text
    assert thought > 0
