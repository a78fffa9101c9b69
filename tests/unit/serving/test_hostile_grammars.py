"""Hostile grammars against a real ``pagedinfer serve``: each fails only its own request.

A corpus of constraints that blow up the grammar engine, accept no string or nest too deep is
sent (with an unconstrained stream running beside them, which must finish untouched, exactly
as alone): each is a 400 naming its field, the same one again is the same 400, the server
stays up (more hostile requests than ``--max-consecutive-failed-steps``), and its log holds no
traceback. A second server runs without the submission probe (``--grammar-probe-tokens 0``),
so the blow-ups happen at run time: a non-streaming request gets a 400 error response, a
streaming one an error event then ``[DONE]``, and the stream beside them is untouched.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.unit.serving.conftest import MODEL_NAME, ServerProcess, start_server

pytest.importorskip("llguidance")


def nested_text(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + "{}" + "}}" * depth


def nested(depth: int) -> dict[str, Any]:
    root: dict[str, Any] = {"type": "object"}
    current = root
    for _ in range(depth):
        child: dict[str, Any] = {"type": "object"}
        current["properties"] = {"a": child}
        current = child
    return root


BLOW_UPS: list[tuple[str, dict[str, Any]]] = [
    ("guided_regex", {"guided_regex": "a{1000000}"}),
    ("guided_regex", {"guided_regex": "((a{100}){100}){100}"}),
    ("guided_grammar", {"guided_grammar": "start: /c{1000000}/"}),
]
CORPUS: list[tuple[str, dict[str, Any]]] = [
    *BLOW_UPS,
    ("guided_regex", {"guided_regex": r"[^\s\S]"}),
    ("guided_json", {"guided_json": {"$ref": "#"}}),
    ("guided_json", {"guided_json": nested(300)}),
    ("guided_json", {"guided_json": nested_text(600)}),
    ("guided_regex", {"guided_regex": "(x{1000}){1000}"}),
    ("guided_choice", {"guided_choice": ["a" * 70000]}),
    (
        "guided_json",
        {
            "guided_json": {
                "type": "object",
                "properties": {"p": {"type": "string", "pattern": "^d{1000000}$"}},
                "required": ["p"],
                "additionalProperties": False,
            }
        },
    ),
]
PLAIN = {
    "model": MODEL_NAME,
    "prompt": [5, 6, 7, 8],
    "max_tokens": 400,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Any) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


def _server(checkpoint: Path, directory: Path, *args: str) -> Iterator[ServerProcess]:
    process = start_server(checkpoint, directory / "server.log", args=list(args))
    try:
        yield process
    finally:
        process.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _server(checkpoint, tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="module")
def unprobed(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _server(
        checkpoint, tmp_path_factory.mktemp("unprobed"), "--grammar-probe-tokens", "0"
    )


def post(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.api_url + "/completions", json=body, timeout=120)


def stream_events(server: ServerProcess, body: dict[str, Any]) -> list[str]:
    events = []
    with httpx.stream(
        "POST", server.api_url + "/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    return events


def stream_text(events: list[str]) -> str:
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if e != "[DONE]")


class Beside:
    """An unconstrained stream running in a thread while the hostile requests go in."""

    def __init__(self, server: ServerProcess) -> None:
        self.events: list[str] = []
        self.thread = threading.Thread(target=self._run, args=(server,))
        self.thread.start()

    def _run(self, server: ServerProcess) -> None:
        self.events = stream_events(server, PLAIN)

    def text(self) -> str:
        self.thread.join(timeout=300)
        return stream_text(self.events)


def test_hostile_grammars_are_400s_naming_the_field(server: ServerProcess) -> None:
    alone = stream_text(stream_events(server, PLAIN))
    beside = Beside(server)
    for field, constraint in CORPUS:
        for _ in range(2):  # the same again: the same answer
            response = post(
                server, {"model": MODEL_NAME, "prompt": "x", "max_tokens": 5, **constraint}
            )
            assert response.status_code == 400, (field, response.text)
            error = response.json()["error"]
            assert field in error["message"] or error["param"] == field, error
    assert beside.text() == alone
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert server.process.poll() is None
    assert "Traceback" not in server.log()


def test_run_time_failures_end_only_their_request(unprobed: ServerProcess) -> None:
    server = unprobed
    alone = stream_text(stream_events(server, PLAIN))
    beside = Beside(server)
    for _, constraint in BLOW_UPS * 2:  # more than --max-consecutive-failed-steps
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 5, **constraint}
        response = post(server, body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "constraint_failed"
        events = stream_events(server, body)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "constraint_failed" and "constraint" in error["message"]
    assert beside.text() == alone
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    ok = post(
        server, {"model": MODEL_NAME, "prompt": "x", "max_tokens": 6, "guided_regex": "[0-9]{3}"}
    )
    assert ok.status_code == 200
    choice = ok.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"].isdigit()
    assert server.process.poll() is None
    assert "Traceback" not in server.log()
    log = server.log()
    assert log.count("failed: the structured-output constraint") >= 2 * len(BLOW_UPS)
