"""``/v1/chat/completions`` with ``--reasoning-parser qwen3``, in-process, on a random model
whose vocabulary has ``<think>`` and ``</think>`` as tokens (``thinking_checkpoint``).

``logit_bias`` scripts the answers: a huge bias on a word makes the model think in it until
``max_tokens`` (no ``</think>``: all reasoning), one on ``</think>`` ends the reasoning at
once, after which ``response_format`` or ``tool_choice`` constrain the answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedinfer import AsyncEngine
from pagedinfer.cli import EXIT_USER_ERROR, main
from pagedinfer.serving import ServingOptions, build_app

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

KWARGS: dict[str, Any] = {"device": "cpu", "kv_block_size": 16, "num_kv_blocks": 64}
KWARGS["max_model_len"] = 256
OPTIONS = ServingOptions(
    reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True
)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    }
]


@pytest.fixture(scope="module")
def engine(thinking_checkpoint: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(thinking_checkpoint, **KWARGS)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def ids(engine: AsyncEngine) -> dict[str, int]:
    tokenizer = engine.tokenizer
    return {
        "end": tokenizer.convert_tokens_to_ids("</think>"),
        "word": tokenizer.encode("Hello")[0],
    }


def _post(app: Any, body: dict[str, Any]) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json=body)

    return asyncio.run(asyncio.wait_for(main(), 120))


def _chat(engine: AsyncEngine, options: ServingOptions = OPTIONS, **body: Any) -> Any:
    body = {"model": "m", "messages": MESSAGES, "temperature": 0, **body}
    response = _post(build_app(engine, served_model_name="m", options=options), body)
    if body.get("stream"):
        assert response.status_code == 200, response.text
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(event) for event in events[:-1]]
    return response


def _message(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return {**choice["message"], "finish_reason": choice["finish_reason"]}


def _joined(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


def _bias(**biases: float) -> Callable[[dict[str, int]], dict[str, float]]:
    return lambda ids: {str(ids[name]): value for name, value in biases.items()}


def test_a_thought_cut_by_max_tokens_is_reasoning_and_no_content(
    engine: AsyncEngine, ids: dict[str, int]
) -> None:
    bias = _bias(word=100)(ids)
    message = _message(_chat(engine, max_tokens=5, logit_bias=bias))
    assert message["reasoning_content"] and message["reasoning_content"] == message["reasoning"]
    assert message["content"] is None and message["finish_reason"] == "length"
    chunks = _chat(engine, max_tokens=5, logit_bias=bias, stream=True)
    assert _joined(chunks, "reasoning_content") == message["reasoning_content"]
    assert _joined(chunks, "content") == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_enable_thinking_false_makes_the_answer_content(
    engine: AsyncEngine, ids: dict[str, int]
) -> None:
    bias = _bias(word=100)(ids)
    thinking = _message(_chat(engine, max_tokens=5, logit_bias=bias))
    for off in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        message = _message(_chat(engine, max_tokens=5, logit_bias=bias, **off))
        assert message["reasoning_content"] is None
        assert message["content"] == thinking["reasoning_content"]


def test_include_reasoning_false_leaves_it_out(engine: AsyncEngine, ids: dict[str, int]) -> None:
    bias = _bias(word=100)(ids)
    message = _message(_chat(engine, max_tokens=5, logit_bias=bias, include_reasoning=False))
    assert message["reasoning_content"] is None and message["content"] is None
    chunks = _chat(engine, max_tokens=5, logit_bias=bias, include_reasoning=False, stream=True)
    assert _joined(chunks, "reasoning_content") == ""


def test_response_format_applies_after_the_reasoning(
    engine: AsyncEngine, ids: dict[str, int]
) -> None:
    bias = _bias(end=100)(ids)
    body = {
        "max_tokens": 30,
        "logit_bias": bias,
        "response_format": RESPONSE_FORMAT,
        "structured_outputs": {"disable_any_whitespace": True},  # no runaway whitespace
    }
    message = _message(_chat(engine, **body))
    assert message["reasoning_content"] == ""  # </think> came first, unconstrained
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    chunks = _chat(engine, stream=True, **body)
    assert _joined(chunks, "content") == message["content"]
    # Thinking off: the grammar applies from the first token (</think> is masked).
    off = _message(_chat(engine, chat_template_kwargs={"enable_thinking": False}, **body))
    assert off["reasoning_content"] is None
    jsonschema.validate(json.loads(off["content"]), SCHEMA)


def test_the_reasoning_before_the_end_is_unconstrained(
    engine: AsyncEngine, ids: dict[str, int]
) -> None:
    message = _message(
        _chat(
            engine,
            max_tokens=5,
            logit_bias=_bias(word=100)(ids),
            response_format=RESPONSE_FORMAT,
        )
    )
    assert message["reasoning_content"] and not message["reasoning_content"].startswith("{")
    assert message["content"] is None


def test_required_tool_calls_are_read_from_the_answer_after_the_reasoning(
    engine: AsyncEngine, ids: dict[str, int]
) -> None:
    body = {
        "max_tokens": 100,
        "logit_bias": _bias(end=100)(ids),
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,  # one call, so that it ends
    }
    message = _message(_chat(engine, **body))
    assert message["reasoning_content"] == ""
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")
    assert message["finish_reason"] == "tool_calls"
    chunks = _chat(engine, stream=True, **body)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_time"


def test_include_reasoning_false_without_a_parser_is_a_400(engine: AsyncEngine) -> None:
    response = _chat(engine, ServingOptions(), max_tokens=2, include_reasoning=False)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "include_reasoning"
    assert "--reasoning-parser" in response.json()["error"]["message"]


def test_a_constraint_is_refused_when_the_end_marker_is_no_token(
    make_checkpoint: Callable[..., Path],
) -> None:
    engine = AsyncEngine(make_checkpoint("tiny", with_tokenizer=True), **KWARGS)
    try:
        response = _chat(engine, max_tokens=2, response_format=RESPONSE_FORMAT)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "response_format" and "'</think>'" in error["message"]
        # Text is still split: the marker is read from the text.
        assert _message(_chat(engine, max_tokens=3))["content"] is None
    finally:
        engine.close()


def test_the_serve_flag_names_the_parser_and_refuses_an_unknown_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pagedinfer.serving.server as server

    seen: dict[str, Any] = {}
    monkeypatch.delenv("PAGEDINFER_API_KEY", raising=False)
    monkeypatch.setattr(server, "run_server", lambda model, **kwargs: seen.update(kwargs))
    assert main(["serve", "dir", "--reasoning-parser", "deepseek_r1"]) == 0
    assert seen["options"] == ServingOptions(reasoning_parser="deepseek_r1")
    try:
        status = main(["serve", "dir", "--reasoning-parser", "nope"])
    except SystemExit as exit:  # argparse
        status = exit.code  # type: ignore[assignment]
    assert status == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and "deepseek_r1" in err and "qwen3" in err
    with pytest.raises(ValueError, match="deepseek_r1, deepseek_v3, qwen3"):
        ServingOptions(reasoning_parser="nope")


def test_a_served_thinking_model_with_the_openai_client(
    thinking_checkpoint: Path, ids: dict[str, int], tmp_path: Path
) -> None:
    """One real ``pagedinfer serve --reasoning-parser qwen3``, read with the official client
    (``reasoning_content`` is one of vLLM's extra fields, an attribute of its objects)."""
    openai = pytest.importorskip("openai")
    from tests.unit.serving.conftest import MODEL_NAME, start_server

    server = start_server(
        thinking_checkpoint, tmp_path / "server.log", args=["--reasoning-parser", "qwen3"]
    )
    try:
        client = openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0)
        thought = {str(ids["word"]): 100}
        ask: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0}
        whole = client.chat.completions.create(**ask, max_tokens=5, logit_bias=thought)
        message = whole.choices[0].message
        assert message.reasoning_content and message.content is None
        chunks = list(
            client.chat.completions.create(**ask, max_tokens=5, logit_bias=thought, stream=True)
        )
        streamed = "".join(
            getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            for chunk in chunks
            if chunk.choices
        )
        assert streamed == message.reasoning_content
        answer = client.chat.completions.create(
            **ask,
            max_tokens=30,
            logit_bias={str(ids["end"]): 100},
            response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
            extra_body={"structured_outputs": {"disable_any_whitespace": True}},
        )
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""), SCHEMA)
    finally:
        server.stop()
