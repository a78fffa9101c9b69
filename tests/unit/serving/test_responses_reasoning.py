"""``/v1/responses`` and ``/v1/messages`` with ``--reasoning-parser qwen3``, in-process on the
tiny thinking checkpoint (``</think>`` one token): the reasoning as its own output item /
content block, the same split as chat's ``reasoning_content``, whole and streamed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedinfer import AsyncEngine
from pagedinfer.serving import ServingOptions, build_app

pytest.importorskip("fastapi")

KWARGS: dict[str, Any] = {"device": "cpu", "kv_block_size": 16, "num_kv_blocks": 64}
KWARGS["max_model_len"] = 256
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_output_tokens": 8}


@pytest.fixture(scope="module")
def app(thinking_checkpoint: Path) -> Iterator[Any]:
    engine = AsyncEngine(thinking_checkpoint, **KWARGS)
    try:
        yield build_app(
            engine, served_model_name="m", options=ServingOptions(reasoning_parser="qwen3")
        )
    finally:
        engine.close()


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, timeout=120)

    return asyncio.run(asyncio.wait_for(main(), 120))


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    blocks = [block for block in response.text.split("\n\n") if block.strip()]
    return [json.loads(block.split("\ndata: ")[1]) for block in blocks]


def _chat(app: Any, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "Think"}], "temperature": 0.0}
    response = _post(app, "/v1/chat/completions", {**body, "max_tokens": 8, **extra})
    message: dict[str, Any] = response.json()["choices"][0]["message"]
    return message


@pytest.mark.parametrize("effort", [None, "none"])
def test_reasoning_items_split_as_chat_splits(app: Any, effort: str | None) -> None:
    extra = {} if effort is None else {"reasoning": {"effort": effort}}
    chat = _chat(app, **({} if effort is None else {"reasoning_effort": effort}))
    body = {"input": "Think", **GREEDY, **extra}
    response = _post(app, "/v1/responses", body).json()
    items = {item["type"]: item for item in response["output"]}
    reasoning = chat["reasoning_content"]
    if reasoning:
        assert items["reasoning"]["content"] == [{"type": "reasoning_text", "text": reasoning}]
        details = response["usage"]["output_tokens_details"]
        assert 0 < details["reasoning_tokens"] <= response["usage"]["output_tokens"]
    else:
        assert "reasoning" not in items
        assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    if chat["content"]:
        assert items["message"]["content"][0]["text"] == chat["content"]
    else:
        assert "message" not in items
    events = _events(_post(app, "/v1/responses", {**body, "stream": True}))
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert streamed == (reasoning or "")
    assert events[-1]["response"]["usage"] == response["usage"] | {
        "input_tokens_details": events[-1]["response"]["usage"]["input_tokens_details"]
    }
    message = _post(
        app,
        "/v1/messages",
        {"messages": [{"role": "user", "content": "Think"}], "max_tokens": 8, "temperature": 0.0}
        | ({} if effort is None else {"thinking": {"type": "disabled"}}),
    ).json()
    kinds = [block["type"] for block in message["content"]]
    assert ("thinking" in kinds) is bool(reasoning)
