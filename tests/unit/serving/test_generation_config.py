"""``pagedinfer serve`` applies the checkpoint's ``generation_config.json`` to the fields a
request leaves out, as ``vllm serve`` does (``--generation-config auto``, the default), and
``--generation-config vllm`` ignores it (issue 46: with ``top_k: 1, max_new_tokens: 5`` there,
two identical chats gave 4,053 and 2,917 tokens of different text)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from pagedinfer import AsyncEngine
from pagedinfer.serving import build_app
from pagedinfer.serving.generation_defaults import apply_generation_defaults
from pagedinfer.serving.protocol import ChatCompletionRequest

KWARGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "num_kv_blocks": 64,
    "max_model_len": 256,
}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story."}]}


@pytest.fixture(scope="module")
def model(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("generation-config") / "model"
    shutil.copytree(make_checkpoint("tiny", with_tokenizer=True), model)
    config = {"do_sample": True, "top_k": 1, "max_new_tokens": 5}
    (model / "generation_config.json").write_text(json.dumps(config))
    return model


def _chats(model: Path, body: dict[str, Any], **options: Any) -> list[dict[str, Any]]:
    engine = AsyncEngine(model, **KWARGS, **options)
    app = build_app(engine, served_model_name="m")

    async def main() -> list[dict[str, Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answers = []
            for _ in range(2):
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                answers.append(response.json())
            return answers

    try:
        return asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        engine.close()


def test_the_models_generation_config_gives_the_defaults_of_a_chat(model: Path) -> None:
    first, second = _chats(model, CHAT)
    assert first["usage"]["completion_tokens"] <= 5  # max_new_tokens
    text = first["choices"][0]["message"]["content"]
    assert text == second["choices"][0]["message"]["content"]  # top_k 1: one answer


def test_a_field_the_request_sends_wins_and_vllm_ignores_the_file(model: Path) -> None:
    (sent,) = _chats(model, {**CHAT, "max_tokens": 9, "min_tokens": 9})[:1]
    assert sent["usage"]["completion_tokens"] == 9
    ignored, _ = _chats(model, {**CHAT, "min_tokens": 9}, generation_config="vllm")
    assert ignored["usage"]["completion_tokens"] > 5


def test_defaults_fill_only_what_a_request_leaves_out() -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 5}
    body = ChatCompletionRequest.model_validate(
        {**CHAT, "temperature": 1.0, "top_k": None, "max_completion_tokens": 7}
    )
    apply_generation_defaults(body, defaults)
    assert (body.temperature, body.top_k, body.max_tokens, body.output_tokens) == (1.0, 20, None, 7)
    body = ChatCompletionRequest.model_validate(CHAT)
    apply_generation_defaults(body, defaults)
    assert (body.temperature, body.top_k, body.output_tokens) == (0.6, 20, 5)
