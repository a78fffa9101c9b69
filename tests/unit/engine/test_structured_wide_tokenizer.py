"""A tokenizer with more ids than the model's logits (added tokens past ``vocab_size``):
structured outputs still compile (llguidance needs a bit per token the tokenizer knows) and
never sample an id past the logits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint, build_tokenizer
from pagedinfer.domain.structured import StructuredOutputsParams

pytest.importorskip("llguidance")


def test_a_wider_tokenizer_constrains_within_the_logits(tmp_path: Path) -> None:
    checkpoint = build_random_checkpoint(
        tmp_path / "model", "tiny", vocab_size=512, with_tokenizer=True
    )
    build_tokenizer(600).save_pretrained(str(checkpoint))  # 88 ids the model cannot emit
    params = SamplingParams(
        max_tokens=12,
        temperature=1.0,
        seed=3,
        structured_outputs=StructuredOutputsParams(regex="[ab]{3,8}"),
    )
    with Engine(checkpoint, device="cpu", dtype="float32", num_kv_blocks=32) as engine:
        [output] = engine.generate(["ab"], params, use_tqdm=False)
    completion = output.outputs[0]
    assert max(completion.token_ids) < 512
    assert re.fullmatch("[ab]{3,8}", completion.text), completion.text
