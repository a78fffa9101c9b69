"""The app in-process (httpx's ASGI transport) when the engine dies: nothing hangs, every
request gets an error and /health says so."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from pagedinfer import AsyncEngine
from pagedinfer.serving import build_app


def test_a_dead_engine_answers_503_and_ends_streams_with_an_error(
    make_checkpoint: Callable[..., Path],
) -> None:
    checkpoint = make_checkpoint("tiny", with_tokenizer=True)
    engine = AsyncEngine(
        checkpoint, device="cpu", kv_block_size=16, num_kv_blocks=64, max_model_len=256
    )
    executor = engine.engine._executor
    assert executor is not None
    execute = executor.execute
    calls = 0

    def failing_execute(plan: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected device failure")
        return execute(plan)

    executor.execute = failing_execute  # type: ignore[method-assign]
    app = build_app(engine, served_model_name="m")

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            body = {"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
            streamed = await client.post("/v1/completions", json=body)
            assert streamed.status_code == 200  # the stream had started
            events = [e for e in streamed.text.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2][6:])["error"]
            assert error["type"] == "server_error" and "injected device failure" in error["message"]
            assert engine.is_dead
            refused = await client.post("/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "engine_unavailable"
            health = await client.get("/health")
            assert health.status_code == 503 and "injected" in health.json()["error"]["message"]
            assert (await client.get("/metrics")).status_code == 200

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        engine.close()
