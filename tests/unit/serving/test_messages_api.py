"""Anthropic's ``POST /v1/messages`` in-process on the tiny checkpoint: the body translated
into a chat, the message and its content blocks, the streamed events, and what is refused.
(The ``anthropic`` client is not a dependency: the bodies are checked as its docs define
them.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedinfer import AsyncEngine
from pagedinfer.serving import build_app
from pagedinfer.serving.anthropic_api.output import stop_reason
from pagedinfer.serving.anthropic_api.request import MessagesRequest, chat_request
from pagedinfer.serving.responses import Completion

pytest.importorskip("fastapi")

KWARGS: dict[str, Any] = {"device": "cpu", "kv_block_size": 16, "num_kv_blocks": 64}
KWARGS["max_model_len"] = 256
USER = [{"role": "user", "content": "Hello"}]
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def app(make_checkpoint: Callable[..., Path]) -> Iterator[Any]:
    engine = AsyncEngine(make_checkpoint("tiny", with_tokenizer=True), **KWARGS)
    try:
        yield build_app(engine, served_model_name="m")
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
    events = []
    for block in response.text.split("\n\n"):
        if block.strip():
            kind, data = block.split("\n")
            body = json.loads(data[len("data: ") :])
            assert kind == f"event: {body['type']}"
            events.append(body)
    return events


def test_the_body_becomes_a_chat() -> None:
    request = MessagesRequest.model_validate(
        {
            "max_tokens": 9,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "call it", "signature": "s"},
                        {
                            "type": "tool_use",
                            "id": "t1",
                            "name": "get_weather",
                            "input": {"city": "Oslo"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                        {"type": "text", "text": "So?"},
                    ],
                },
            ],
            "tools": [TOOL],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "top_k": 5,
        }
    )
    chat = chat_request(request)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "call it",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "t1"},
        {"role": "user", "content": "So?"},
    ]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.max_tokens == 9 and chat.stop == ["END"] and chat.top_k == 5
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": TOOL["input_schema"],
                "description": TOOL["description"],
            },
        }
    ]


def test_stop_reasons() -> None:
    def done(finish: str, stop: int | str | None = None) -> Completion:
        return Completion(0, "x", [1], finish, stop, None)

    assert stop_reason(done("length"), False) == ("max_tokens", None)
    assert stop_reason(done("stop", "END"), False) == ("stop_sequence", "END")
    assert stop_reason(done("stop"), False) == ("end_turn", None)
    assert stop_reason(done("stop", 7), False) == ("end_turn", None)  # a stop token id
    assert stop_reason(done("stop"), True) == ("tool_use", None)


def test_a_message_and_its_stream(app: Any) -> None:
    body = {"messages": USER, "max_tokens": 6, "temperature": 0.0}
    chat = _post(app, "/v1/chat/completions", body).json()
    message = _post(app, "/v1/messages", body).json()
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["id"].startswith("msg_") and message["model"] == "m"
    assert message["content"] == [
        {"type": "text", "text": chat["choices"][0]["message"]["content"]}
    ]
    usage = message["usage"]
    assert (
        usage["input_tokens"] + usage["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"]
    )
    assert usage["output_tokens"] == chat["usage"]["completion_tokens"]
    expected = "max_tokens" if chat["choices"][0]["finish_reason"] == "length" else "end_turn"
    assert message["stop_reason"] == expected and message["stop_sequence"] is None
    events = _events(_post(app, "/v1/messages", {**body, "stream": True}))
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == message["content"][0]["text"]
    assert events[-2]["delta"] == {"stop_reason": expected, "stop_sequence": None}
    assert events[-2]["usage"] == {"output_tokens": usage["output_tokens"]}
    assert events[0]["message"]["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_a_named_tool_gives_a_tool_use_block(app: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "max_tokens": 40,
        "temperature": 0.0,
    }
    message = _post(app, "/v1/messages", body).json()
    (block,) = message["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert set(block["input"]) == {"city"} and block["id"]
    assert message["stop_reason"] == "tool_use"
    events = _events(_post(app, "/v1/messages", {**body, "stream": True}))
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [start["type"] for start in starts] == ["tool_use"]
    partial = "".join(
        e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
    )
    assert json.loads(partial) == block["input"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    # The call and its result go back (the agent loop).
    follow_up = {
        "messages": [
            *body["messages"],
            {"role": "assistant", "content": [block]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": block["id"], "content": "sunny"}
                ],
            },
        ],
        "tools": [TOOL],
        "tool_choice": {"type": "none"},
        "max_tokens": 4,
    }
    answer = _post(app, "/v1/messages", follow_up)
    assert answer.status_code == 200 and answer.json()["content"][0]["type"] == "text"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]",
        ),
        ({"frobnicate": 1}, "frobnicate"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"model": "other"}, "model"),
    ],
)
def test_what_is_not_served_is_refused_naming_it(
    app: Any, body: dict[str, Any], param: str
) -> None:
    response = _post(app, "/v1/messages", {"messages": USER, "max_tokens": 4, **body})
    assert response.status_code in (400, 404)
    assert response.json()["error"]["param"] == param
    missing = _post(app, "/v1/messages", {"messages": USER})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "max_tokens"
