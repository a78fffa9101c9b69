"""The app's routes are module-level handlers (``serving/routes/``) that take the app's
``ServingState`` as a dependency; ``build_app`` only wires them. In-process, on the tiny
checkpoint."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from pagedinfer import AsyncEngine
from pagedinfer.engine.outputs import CompletionOutput, RequestOutput
from pagedinfer.serving import ServingOptions, build_app
from pagedinfer.serving.errors import OpenAIError
from pagedinfer.serving.state import ServingState
from pagedinfer.serving.streaming import finish_reason

KWARGS: dict[str, Any] = {"device": "cpu", "kv_block_size": 16, "num_kv_blocks": 64}
KWARGS["max_model_len"] = 256
ROUTES = {
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/version"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id:path}"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("POST", "/invocations"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/embeddings"),
    ("POST", "/score"),
    ("POST", "/v1/score"),
    ("POST", "/rerank"),
    ("POST", "/v1/rerank"),
    ("POST", "/v2/rerank"),
}


@pytest.fixture(scope="module")
def engine(make_checkpoint: Callable[..., Path]) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(make_checkpoint("tiny", with_tokenizer=True), **KWARGS)
    try:
        yield engine
    finally:
        engine.close()


def _run(app: Any, scenario: Callable[[httpx.AsyncClient], Any]) -> Any:
    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await scenario(client)

    return asyncio.run(asyncio.wait_for(main(), 120))


def test_the_routes_are_module_level_handlers_and_the_app_serves_them(
    engine: AsyncEngine,
) -> None:
    app = build_app(engine, served_model_name="m")
    routes = [route for route in app.routes if isinstance(route, APIRoute)]
    assert {(method, route.path) for route in routes for method in route.methods} == ROUTES
    for route in routes:
        handler = route.endpoint
        assert handler.__module__.startswith("pagedinfer.serving.routes."), route.path
        assert handler.__qualname__ == handler.__name__, route.path  # not a closure

    async def scenario(client: httpx.AsyncClient) -> list[int]:
        answers = [await client.get(path) for path in ("/health", "/version", "/v1/models/m")]
        answers.append(await client.post("/detokenize", json={"tokens": [1, 2]}))
        # A generating model has no pooling routes: a 400 that names the runner.
        refused = await client.post("/v1/embeddings", json={"input": "hi"})
        assert "--runner pooling" in refused.json()["error"]["message"]
        answers.append(refused)
        return [answer.status_code for answer in answers]

    assert _run(app, scenario) == [200, 200, 200, 200, 400]


def test_each_app_reads_its_own_state(engine: AsyncEngine) -> None:
    """Two apps on one engine, under two names: each route answers with its app's state."""
    first = build_app(engine, served_model_name="first")
    second = build_app(engine, served_model_name="second", options=ServingOptions(api_key="k"))
    assert isinstance(first.state.serving, ServingState)
    assert first.state.serving.served_model_name == "first"
    assert first.state.engine is engine and first.state.metrics is first.state.serving.metrics

    async def scenario(client: httpx.AsyncClient) -> list[Any]:
        models = await client.get("/v1/models")
        other = await client.get("/v1/models/second")
        return [models.json()["data"][0]["id"], other.status_code]

    assert _run(first, scenario) == ["first", 404]

    async def keyed(client: httpx.AsyncClient) -> list[int]:
        plain = await client.get("/v1/models/second")
        with_key = await client.get("/v1/models/second", headers={"Authorization": "Bearer k"})
        return [plain.status_code, with_key.status_code]

    assert _run(second, keyed) == [401, 200]


def test_the_state_checks_the_model_and_redacts_the_checkpoint_path(engine: AsyncEngine) -> None:
    state = ServingState.build(engine, "served", ServingOptions())
    state.check_model(None)
    state.check_model("served")
    with pytest.raises(OpenAIError) as raised:
        state.check_model("other")
    assert raised.value.status == 404 and "`served`" in str(raised.value.message)
    path = engine.engine.config.model_path
    redact = state.redactor()
    assert redact(f"no file in {path} or {os.path.abspath(path)}") == "no file in served or served"
    assert state.decode([]) == "" and isinstance(state.token_text(1), str)


def _output(*reasons: str | None) -> RequestOutput:
    completions = [
        CompletionOutput(i, "", [], None, None, finish_reason=reason)
        for i, reason in enumerate(reasons)
    ]
    return RequestOutput("0", "", [1], None, completions, True, 0)


def test_a_requests_finish_reason_for_the_metrics() -> None:
    assert finish_reason(_output("length", "stop")) == "length"
    assert finish_reason(_output("stop", "abort")) == "abort"
    assert finish_reason(_output(None)) is None
