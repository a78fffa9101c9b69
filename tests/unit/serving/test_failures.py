"""The server's failure policy, in-process (issue 21 items 1 and 3; issue 30 item 4).

A step that fails fails only its requests: a plain request gets a 500 with OpenAI's error
JSON and a generic message, a stream an error event and ``[DONE]``; the engine logs the
traceback; other requests are served and ``/health`` stays 200. A fatal failure makes the
engine dead: 503 everywhere, ``/health`` 503 with a short body, and the server shuts down
(:func:`serve_engine` raises ``EngineDeadError``; the command line's exit code is tested in
test_security.py with a real process). A closed engine (not dead) answers 503 as well.

Before, the first failing step (the greedy + top-k pair of issue 21) answered 503 to every
request and ``/health`` forever, logged nothing, and put the exception's repr in the bodies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedinfer import AsyncEngine
from pagedinfer.errors import EngineDeadError, WorkerDiedError
from pagedinfer.serving import build_app
from pagedinfer.serving.server import bind_socket, serve_engine

SECRET = "/very/secret/path injected device failure"
KWARGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "num_kv_blocks": 64,
    "max_model_len": 256,
}
BODY = {"prompt": "hello", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture
def engine(checkpoint: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(checkpoint, **KWARGS)
    try:
        yield engine
    finally:
        engine.close()


def fail_next_steps(
    engine: AsyncEngine, error: Callable[[], BaseException], count: int = 1
) -> None:
    """The executor raises ``error()`` on its next ``count`` calls, then works again."""
    executor = engine.engine._executor
    assert executor is not None
    real = executor.execute
    left = [count]

    def execute(plan: Any) -> Any:
        if left[0] > 0:
            left[0] -= 1
            raise error()
        return real(plan)

    executor.execute = execute  # type: ignore[method-assign]


def run(app: Any, scenario: Callable[[httpx.AsyncClient], Any]) -> Any:
    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await scenario(client)

    return asyncio.run(asyncio.wait_for(main(), 120))


def events(text: str) -> list[str]:
    return [event[6:] for event in text.split("\n\n") if event.startswith("data: ")]


def assert_generic(error: dict[str, Any]) -> None:
    """An error body that says nothing of the server's internals."""
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error"
    for leak in ("secret", "injected", "Error(", "Traceback", "/"):
        assert leak not in error["message"], error["message"]


def test_a_failed_step_fails_its_request_with_a_500_and_the_server_goes_on(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    app = build_app(engine, served_model_name="m")

    async def scenario(client: httpx.AsyncClient) -> None:
        fail_next_steps(engine, lambda: RuntimeError(SECRET))
        failed = await client.post("/v1/completions", json=BODY)
        assert failed.status_code == 500, failed.text
        assert_generic(failed.json()["error"])
        # Served again: the engine lives, /health says so, the next request is fine.
        assert (await client.get("/health")).status_code == 200
        ok = await client.post("/v1/completions", json=BODY)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        # A stream whose step fails ends with an error event, then [DONE].
        fail_next_steps(engine, lambda: RuntimeError(SECRET))
        streamed = await client.post("/v1/completions", json={**BODY, "stream": True})
        assert streamed.status_code == 200  # the stream had started
        data = events(streamed.text)
        assert data[-1] == "[DONE]"
        assert_generic(json.loads(data[-2])["error"])
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        fail_next_steps(engine, lambda: RuntimeError(SECRET))
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 500
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        assert (await client.get("/health")).status_code == 200
        metrics = (await client.get("/metrics")).text
        assert 'pagedinfer_requests_rejected_total{status="500"} 2.0' in metrics
        assert 'pagedinfer_requests_finished_total{finish_reason="error"} 3.0' in metrics

    with caplog.at_level(logging.ERROR, logger="pagedinfer"):
        run(app, scenario)
    assert not engine.is_dead
    # The failures are logged with their tracebacks (by the engine), once each.
    logged = [r for r in caplog.records if r.exc_info and SECRET in str(r.exc_info[1])]
    assert len(logged) == 3, [r.getMessage() for r in caplog.records]


def test_a_fatal_failure_answers_503_and_health_tells(engine: AsyncEngine) -> None:
    app = build_app(engine, served_model_name="m")
    died: list[BaseException] = []
    engine.on_dead(died.append)

    async def scenario(client: httpx.AsyncClient) -> None:
        assert (await client.get("/health")).status_code == 200
        fail_next_steps(engine, lambda: WorkerDiedError(SECRET), count=10)
        streamed = await client.post("/v1/completions", json={**BODY, "stream": True})
        data = events(streamed.text)
        assert data[-1] == "[DONE]"
        assert_generic(json.loads(data[-2])["error"])
        assert engine.is_dead
        for _ in range(100):  # the step thread calls on_dead after failing the streams
            if died:
                break
            await asyncio.sleep(0.05)
        assert len(died) == 1
        refused = await client.post("/v1/completions", json=BODY)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_unavailable"
        assert_generic(refused.json()["error"])
        health = await client.get("/health")
        assert health.status_code == 503 and len(health.content) < 200
        assert_generic(health.json()["error"])
        assert (await client.get("/metrics")).status_code == 200

    run(app, scenario)


def test_a_closed_engine_answers_503_not_500(engine: AsyncEngine) -> None:
    # Issue 30, item 4: mapping EngineClosedError to 500 survived every test.
    app = build_app(engine, served_model_name="m")
    engine.close()
    assert not engine.is_dead and not engine.is_running

    async def scenario(client: httpx.AsyncClient) -> None:
        for path, body in (
            ("/v1/completions", BODY),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ):
            refused = await client.post(path, json=body)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "engine_unavailable"
            assert "shutting down" in refused.json()["error"]["message"]
        health = await client.get("/health")
        assert health.status_code == 503 and "shutting down" in health.text

    run(app, scenario)


def test_the_server_shuts_down_when_the_engine_dies(engine: AsyncEngine) -> None:
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    outcome: list[BaseException | None] = []

    def serve() -> None:
        try:
            serve_engine(engine, sock, served_model_name="m", log_level="warning")
        except BaseException as error:  # what the command line sees
            outcome.append(error)
        else:
            outcome.append(None)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=base, timeout=30) as client:
        assert client.get("/health").status_code == 200
        fail_next_steps(engine, lambda: WorkerDiedError(SECRET), count=10)
        response = client.post("/v1/completions", json=BODY)
        assert response.status_code == 503
        assert_generic(response.json()["error"])
    thread.join(timeout=30)
    assert not thread.is_alive(), "the server did not shut down after the engine died"
    assert len(outcome) == 1 and isinstance(outcome[0], EngineDeadError)
    causes = []
    error: BaseException | None = outcome[0]
    while error is not None:
        causes.append(error)
        error = error.__cause__
    assert any(isinstance(cause, WorkerDiedError) for cause in causes)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # nobody listens any more
