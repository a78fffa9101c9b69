"""vLLM's sleep-mode endpoints behind ``--enable-sleep-mode`` and the API key (issue 40;
docs/sleep_mode.md): in-process, through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")

from pagedinfer import AsyncEngine
from pagedinfer.serving import build_app
from pagedinfer.serving.options import ServingOptions

KEY = {"Authorization": "Bearer secret"}
BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Iterator[AsyncEngine]:
    built = AsyncEngine(
        tiny_checkpoint, device="cpu", kv_block_size=16, num_kv_blocks=64, max_model_len=64
    )
    yield built
    built.close()


def _client(engine: AsyncEngine, **options: object) -> httpx.AsyncClient:
    app = build_app(engine, served_model_name="m", options=ServingOptions(**options))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_sleep_wake_pause_resume_over_http(engine: AsyncEngine) -> None:
    async def main() -> None:
        async with _client(engine, api_key="secret", enable_sleep_mode=True) as client:
            assert (await client.post("/sleep?level=1")).status_code == 401  # key needed
            assert (await client.post("/sleep?level=1", headers=KEY)).status_code == 200
            answer = await client.get("/is_sleeping", headers=KEY)
            assert answer.json() == {"is_sleeping": True}
            refused = await client.post("/v1/completions", json=BODY, headers=KEY)
            assert refused.status_code == 503
            assert "wake_up" in refused.json()["error"]["message"]
            bad = await client.post("/sleep?level=3", headers=KEY)
            assert bad.status_code == 400 and "level" in bad.json()["error"]["message"]
            assert (await client.post("/wake_up", headers=KEY)).status_code == 200
            answer = await client.get("/is_sleeping", headers=KEY)
            assert answer.json() == {"is_sleeping": False}
            assert (await client.post("/pause", headers=KEY)).status_code == 200
            assert (await client.get("/is_paused", headers=KEY)).json() == {"is_paused": True}
            waiting = asyncio.ensure_future(client.post("/v1/completions", json=BODY, headers=KEY))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # queued while paused
            assert (await client.post("/resume", headers=KEY)).status_code == 200
            done = await asyncio.wait_for(waiting, 60)
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3

    asyncio.run(main())


def test_the_endpoints_are_off_without_the_flag(engine: AsyncEngine) -> None:
    async def main() -> None:
        async with _client(engine) as client:
            assert (await client.post("/sleep")).status_code == 404
            assert (await client.get("/is_sleeping")).status_code == 404

    asyncio.run(main())
