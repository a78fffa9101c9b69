"""vLLM's OpenAI-server behaviours the port of its entrypoint tests found missing (issue 41),
in-process on the tiny checkpoint: ``usage.prompt_tokens_details`` only with
``--enable-prompt-tokens-details``, ``stream_options.min_characters``, SageMaker's
``/invocations``, and the wording of two refusals (token ids out of vocabulary, seeds out
of the int64 range)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedinfer import AsyncEngine
from pagedinfer.serving import ServingOptions, build_app

pytest.importorskip("fastapi")

KWARGS: dict[str, Any] = {"device": "cpu", "kv_block_size": 16, "num_kv_blocks": 64}
KWARGS["max_model_len"] = 256
CHAT = [{"role": "user", "content": "Tell me a story"}]
LONG: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(make_checkpoint: Callable[..., Path]) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(make_checkpoint("tiny", with_tokenizer=True), **KWARGS)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> Any:
    return build_app(engine, served_model_name="m")


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, timeout=120)

    return asyncio.run(asyncio.wait_for(main(), 120))


def _chunks(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    data = [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


# ------------------------------------------------------------------------ usage
def test_prompt_tokens_details_only_with_the_servers_flag(engine: AsyncEngine) -> None:
    for flag in (False, True):
        app = build_app(
            engine, served_model_name="m", options=ServingOptions(enable_prompt_tokens_details=flag)
        )
        usages = [
            _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).json()["usage"],
            _post(app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}).json()["usage"],
        ]
        streamed = _chunks(
            _post(
                app,
                "/v1/chat/completions",
                {
                    "messages": CHAT,
                    "max_tokens": 2,
                    "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                },
            )
        )
        usages += [chunk["usage"] for chunk in streamed]
        for usage in usages:
            assert ("prompt_tokens_details" in usage) is flag, usage
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            if flag:
                assert usage["prompt_tokens_details"]["cached_tokens"] >= 0


# ------------------------------------------------------------- min_characters
@pytest.mark.parametrize("min_characters", [1, 8, 25])
def test_min_characters_buffers_the_streamed_deltas(app: Any, min_characters: int) -> None:
    whole = _post(app, "/v1/chat/completions", {"messages": CHAT, **LONG}).json()
    text = whole["choices"][0]["message"]["content"]
    chunks = _chunks(
        _post(
            app,
            "/v1/chat/completions",
            {
                "messages": CHAT,
                "stream": True,
                "stream_options": {"min_characters": min_characters},
                **LONG,
            },
        )
    )
    deltas = [chunk["choices"][0]["delta"].get("content", "") for chunk in chunks]
    assert "".join(deltas) == text
    # Every delta but the last holds at least min_characters characters (the first, the
    # role's, may be empty).
    assert deltas[0] == "" or len(deltas[0]) >= min_characters
    assert all(len(delta) >= min_characters for delta in deltas[1:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    if min_characters > len(text):
        assert len(chunks) == 2  # the role, then everything at the end
    completion = _post(app, "/v1/completions", {"prompt": "Once upon", **LONG}).json()
    pieces = [
        chunk["choices"][0]["text"]
        for chunk in _chunks(
            _post(
                app,
                "/v1/completions",
                {
                    "prompt": "Once upon",
                    "stream": True,
                    "stream_options": {"min_characters": min_characters},
                    **LONG,
                },
            )
        )
    ]
    assert "".join(pieces) == completion["choices"][0]["text"]
    assert all(len(piece) >= min_characters for piece in pieces[:-1])


def test_min_characters_needs_a_stream_and_a_count(app: Any) -> None:
    for options in ({"min_characters": -1}, {"min_characters": "3"}):
        body = {"prompt": "hi", "stream": True, "stream_options": options}
        response = _post(app, "/v1/completions", body)
        assert response.status_code == 400 and "min_characters" in response.text
    response = _post(
        app, "/v1/completions", {"prompt": "hi", "stream_options": {"min_characters": 2}}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"


# -------------------------------------------------------------------- invocations
def test_invocations_dispatch_by_the_body_shape(app: Any) -> None:
    completion = {"model": "m", "prompt": "Hello, my name is", "max_tokens": 5, "temperature": 0.0}
    chat = {"messages": CHAT, "max_tokens": 5, "temperature": 0.0}
    for path_body, kind in ((completion, "text_completion"), (chat, "chat.completion")):
        direct = _post(
            app, "/v1/completions" if "prompt" in path_body else "/v1/chat/completions", path_body
        )
        invoked = _post(app, "/invocations", path_body)
        assert invoked.status_code == 200, invoked.text
        assert invoked.json()["object"] == kind
        assert invoked.json().keys() == direct.json().keys()
        assert invoked.json()["choices"] == direct.json()["choices"]
    streamed = _chunks(_post(app, "/invocations", {**chat, "stream": True}))
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in streamed)
    assert text == _post(app, "/invocations", chat).json()["choices"][0]["message"]["content"]
    for body, status, words in [
        ({"input": "embed me"}, 400, "Cannot find a suitable handler"),
        ([1, 2], 400, "JSON object"),
        ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
        ({"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
        ({"messages": CHAT, "model": "other"}, 404, "does not exist"),
    ]:
        response = _post(app, "/invocations", body)  # type: ignore[arg-type]
        assert response.status_code == status and words in response.json()["error"]["message"]


# ------------------------------------------------------------------ refusals
def test_token_ids_out_of_vocabulary_are_refused_in_vllms_words(
    app: Any, engine: AsyncEngine
) -> None:
    vocab = engine.engine.model_config.vocab_size
    for path, body in [
        ("/v1/completions", {"prompt": [1, vocab + 5], "max_tokens": 2}),
        ("/detokenize", {"tokens": [vocab]}),
    ]:
        response = _post(app, path, body)
        assert response.status_code == 400
        assert "out of vocabulary" in response.json()["error"]["message"]


def test_seeds_outside_int64_name_the_bound(app: Any) -> None:
    for seed, kind, bound in [
        (2**63, "less_than_equal", str(2**63 - 1)),
        (-(2**63) - 1, "greater_than_equal", str(-(2**63))),
    ]:
        response = _post(app, "/v1/chat/completions", {"messages": CHAT, "seed": seed})
        assert response.status_code == 400
        error = response.json()["error"]
        assert kind in error["message"] and bound in error["message"]
        assert error["param"] == "seed"
    for seed in (2**63 - 1, -(2**63)):
        response = _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": seed})
        assert response.status_code == 200
