"""``use_beam_search`` on ``/v1/completions`` (vLLM's extension), in-process on the tiny
checkpoint: ``n`` beams per prompt as ``n`` choices, the engine's beam search exactly; vLLM's
``test_batch_completions`` beam-search case; streamed or with fields beam search does not
apply, a 400 naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedinfer import AsyncEngine, BeamSearchParams
from pagedinfer.engine.beam_search import beam_search
from pagedinfer.serving import build_app

KWARGS: dict[str, Any] = {"device": "cpu", "kv_block_size": 16, "num_kv_blocks": 128}
KWARGS["max_model_len"] = 256
PROMPT = "Hello, my name is"


@pytest.fixture(scope="module")
def engine(make_checkpoint: Callable[..., Path]) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(make_checkpoint("tiny", with_tokenizer=True), **KWARGS)
    try:
        yield engine
    finally:
        engine.close()


def _post(engine: AsyncEngine, *bodies: dict[str, Any]) -> list[httpx.Response]:
    app = build_app(engine, served_model_name="m")

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.post("/v1/completions", json=body) for body in bodies]

    return asyncio.run(asyncio.wait_for(main(), 120))


def test_choices_are_the_engines_beams_best_first(engine: AsyncEngine) -> None:
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 4, "use_beam_search": True}
    (answer,) = _post(engine, {**body, "logprobs": 2, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    (expected,) = beam_search(engine.engine, PROMPT, BeamSearchParams(beam_width=3, max_tokens=4))
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["token_ids"] for c in choices] == [s.output_token_ids for s in expected.sequences]
    assert [c["finish_reason"] for c in choices] == [s.finish_reason for s in expected.sequences]
    decode = engine.tokenizer.decode
    for choice, sequence in zip(choices, expected.sequences, strict=True):
        shown = sequence.output_token_ids
        if sequence.finish_reason == "stop":
            shown = shown[:-1]
        assert choice["text"] == decode(shown)
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(sequence.output_token_ids)
        assert sum(logprobs["token_logprobs"]) == pytest.approx(sequence.cum_logprob, abs=1e-4)
        assert all(len(top) <= 3 for top in logprobs["top_logprobs"])  # 2, plus the chosen
    usage = answer.json()["usage"]
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    assert usage["prompt_tokens"] == len(expected.prompt_token_ids)


def test_vllms_batch_completions_with_beam_search(engine: AsyncEngine) -> None:
    """vLLM's tests/entrypoints/openai/test_completion.py::test_batch_completions (n=2)."""
    for prompt in [PROMPT, [0, 0, 0, 0, 0]]:
        body = {
            "prompt": [prompt, prompt],
            "n": 2,
            "max_tokens": 5,
            "temperature": 0.0,
            "use_beam_search": True,
            "return_token_ids": True,
        }
        (answer,) = _post(engine, body)
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        assert len(choices) == 4
        assert choices[0]["token_ids"] != choices[1]["token_ids"]  # beam search differs
        assert choices[0]["text"] == choices[2]["text"]  # the same prompt twice: the same
        assert choices[1]["text"] == choices[3]["text"]


def test_echo_puts_the_prompt_before_each_beam(engine: AsyncEngine) -> None:
    body = {"prompt": PROMPT, "n": 2, "max_tokens": 3, "use_beam_search": True}
    plain, echoed = _post(engine, body, {**body, "echo": True})
    for choice, echo in zip(plain.json()["choices"], echoed.json()["choices"], strict=True):
        assert echo["text"] == PROMPT + choice["text"]


def test_what_beam_search_cannot_serve_is_a_400_naming_the_field(engine: AsyncEngine) -> None:
    base = {"prompt": PROMPT, "n": 2, "max_tokens": 3, "use_beam_search": True}
    cases = [
        ({**base, "stream": True}, "stream", "cannot be streamed"),
        ({**base, "top_p": 0.5}, "top_p", "does not apply to beam search"),
        ({**base, "stop": ["x"]}, "stop", "does not apply to beam search"),
        ({**base, "seed": 3}, "seed", "does not apply to beam search"),
        ({**base, "response_format": {"type": "json_object"}}, "response_format", "structured"),
        ({**base, "best_of": 3}, "best_of", "best_of must equal n"),
        ({**base, "use_beam_search": False, "length_penalty": 0.5}, "length_penalty", "only"),
        ({**base, "n": 11}, None, "max_logprobs=20"),
        ({**base, "max_tokens": 0}, None, "BeamSearchParams.max_tokens=0"),
    ]
    answers = _post(engine, *(body for body, _, _ in cases))
    for (_, param, message), answer in zip(cases, answers, strict=True):
        assert answer.status_code == 400, (param, answer.text)
        error = answer.json()["error"]
        assert message in error["message"], error
        if param is not None:
            assert error["param"] == param
    # What asks for nothing is accepted: neutral values, length_penalty with beam search.
    neutral = {**base, "top_p": 1.0, "stop": [], "seed": -1, "length_penalty": 0.5}
    (answer,) = _post(engine, neutral)
    assert answer.status_code == 200, answer.text
    assert not engine.engine.has_unfinished_requests()
