"""The server with speculative decoding (issue 26), in-process: vLLM's ``spec_decode``
counters on ``/metrics`` (``pagedinfer_`` names, docs/serving.md's table), only when the
engine speculates; several tokens per step reach plain and streamed answers whole."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedinfer import AsyncEngine
from pagedinfer.serving import build_app

from .test_failures import events, run

KWARGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "num_kv_blocks": 64,
    "max_model_len": 256,
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
BODY = {"prompt": "hello hello", "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
SPEC = "pagedinfer_spec_decode_"


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


def _values(text: str) -> dict[str, float]:
    """/metrics as {name{labels}: value}, comments left out."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _serve(checkpoint: Path, scenario: Callable[[httpx.AsyncClient], Any], **kwargs: Any) -> Any:
    engine = AsyncEngine(checkpoint, **KWARGS, **kwargs)
    try:
        return run(build_app(engine, served_model_name="m"), scenario)
    finally:
        engine.close()


def _scenario(speculative: bool) -> Callable[[httpx.AsyncClient], Any]:
    """A plain and a streamed greedy completion, then /metrics; with speculation, a
    constrained request is refused (400, naming speculative decoding) first."""

    async def scenario(client: httpx.AsyncClient) -> tuple[dict[str, Any], str, str]:
        if speculative:
            constrained = {"prompt": "hi", "response_format": {"type": "json_object"}}
            refused = await client.post("/v1/completions", json=constrained)
            assert refused.status_code == 400, refused.text
            assert "speculative" in refused.json()["error"]["message"]
        plain = await client.post("/v1/completions", json=BODY)
        assert plain.status_code == 200, plain.text
        streamed = await client.post("/v1/completions", json={**BODY, "stream": True})
        chunks = [json.loads(data) for data in events(streamed.text)[:-1]]
        text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
        return plain.json(), text, (await client.get("/metrics")).text

    return scenario


def test_spec_decode_counters_and_whole_answers(checkpoint: Path) -> None:
    baseline, baseline_text, off = _serve(checkpoint, _scenario(False))
    answer, text, on = _serve(checkpoint, _scenario(True), speculative_config=NGRAM)
    # Without speculation vLLM registers no spec_decode metric; neither does pagedinfer.
    assert SPEC not in off
    # With it: the same greedy answers, whole (several tokens per step, streamed too).
    assert answer["usage"]["completion_tokens"] == 40
    assert answer["choices"][0]["text"] == baseline["choices"][0]["text"] == text
    assert baseline_text == text
    metrics = _values(on)
    drafts = metrics[SPEC + "num_drafts_total"]
    draft_tokens = metrics[SPEC + "num_draft_tokens_total"]
    accepted = metrics[SPEC + "num_accepted_tokens_total"]
    per_position = [
        metrics[SPEC + f'num_accepted_tokens_per_pos_total{{position="{p}"}}'] for p in range(3)
    ]
    assert f'{SPEC}num_accepted_tokens_per_pos_total{{position="3"}}' not in metrics
    assert 0 < accepted < draft_tokens <= 3 * drafts, "drafts should be accepted, not all"
    assert sum(per_position) == accepted
    assert per_position[0] >= per_position[1] >= per_position[2]  # a run is a prefix
    # Tokens = one per verify row plus the accepted drafts (and the rows without drafts).
    assert metrics["pagedinfer_generation_tokens_total"] >= drafts + accepted
