"""``POST /v1/responses`` in-process (the app on the tiny checkpoint through httpx's ASGI
transport): the request translated into a chat, the response object, its stream of events,
the stored responses, and what is refused."""

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
from pagedinfer.serving.fields import FieldPolicy, RequestFieldError
from pagedinfer.serving.responses import Completion, Prompt
from pagedinfer.serving.responses_api.events import ResponseEvents
from pagedinfer.serving.responses_api.output import (
    ResponseShape,
    assistant_message,
    response_body,
)
from pagedinfer.serving.responses_api.request import (
    ResponsesRequest,
    chat_request,
    check_response_fields,
)
from pagedinfer.serving.responses_api.store import ResponseStore
from pagedinfer.serving.translated import ReasoningSplit

pytest.importorskip("fastapi")

KWARGS: dict[str, Any] = {"device": "cpu", "kv_block_size": 16, "num_kv_blocks": 64}
KWARGS["max_model_len"] = 256
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_output_tokens": 5}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def engine(make_checkpoint: Callable[..., Path]) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(make_checkpoint("tiny", with_tokenizer=True), **KWARGS)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> Any:
    return build_app(engine, served_model_name="m", options=ServingOptions())


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, timeout=120)

    return asyncio.run(asyncio.wait_for(main(), 120))


def _get(app: Any, path: str) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path)

    return asyncio.run(asyncio.wait_for(main(), 120))


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        body = json.loads(data[len("data: ") :])
        assert body["type"] == kind[len("event: ") :]
        events.append(body)
    return events


def _chat(app: Any, **body: Any) -> dict[str, Any]:
    response = _post(app, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


# ------------------------------------------------------------------ translation
def test_input_items_become_the_chat_the_template_renders() -> None:
    request = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "call it"}],
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}],
                },
            ],
            "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 7,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "reasoning": {"effort": "low"},
        }
    )
    chat = chat_request(request)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "call it",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Sunny."},
    ]
    assert chat.max_completion_tokens == 7
    assert chat.tools == [
        {
            "type": "function",
            "function": {k: TOOL[k] for k in ("name", "description", "parameters")},
        }
    ]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}},
    }
    assert chat.reasoning_effort == "low"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    request = ResponsesRequest.model_validate({"input": "hi", **body})
    with pytest.raises(RequestFieldError) as error:
        check_response_fields(request, FieldPolicy())
        chat_request(request)
    assert error.value.param == param


def test_the_store_is_bounded_least_recently_used_first() -> None:
    store = ResponseStore(max_responses=2, max_chars=10_000)
    for name in ("a", "b"):
        store.put({"id": name}, [{"role": "user", "content": name}])
    assert store.get("a") is not None  # a is now the most recent
    store.put({"id": "c"}, [])
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    store.put({"id": "big", "x": "y" * 20_000}, [])  # larger than the store: not kept
    assert store.get("big") is None and len(store) == 2
    small = ResponseStore(max_responses=10, max_chars=200)
    for index in range(10):
        small.put({"id": str(index)}, [{"role": "user", "content": "z" * 40}])
    assert 0 < len(small) < 10 and small.get("9") is not None and small.get("0") is None


# ----------------------------------------------------------------------- routes
def test_a_response_is_the_chat_answer_as_output_items(app: Any) -> None:
    chat = _chat(
        app, messages=[{"role": "user", "content": "Hello"}], temperature=0.0, max_tokens=5
    )
    response = _post(app, "/v1/responses", {"input": "Hello", **GREEDY})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["model"] == "m" and body["max_output_tokens"] == 5
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["type"] == "output_text"
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    usage = body["usage"]
    assert usage["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == chat["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert "cached_tokens" in usage["input_tokens_details"]
    if chat["choices"][0]["finish_reason"] == "length":
        assert body["status"] == "incomplete"
        assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    stored = _get(app, f"/v1/responses/{body['id']}")
    assert stored.status_code == 200 and stored.json() == body
    assert _get(app, "/v1/responses/resp_unknown").status_code == 404


def test_the_stream_adds_up_to_the_whole_response(app: Any) -> None:
    whole = _post(app, "/v1/responses", {"input": "Tell me", **GREEDY}).json()
    streamed = _post(app, "/v1/responses", {"input": "Tell me", "stream": True, **GREEDY})
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = _events(streamed)
    kinds = [event["type"] for event in events]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"]
    final = events[-1]["response"]
    assert final["status"] == whole["status"]  # "incomplete" when max_output_tokens cut it
    assert final["output"][0]["content"][0]["text"] == text
    for count in ("input_tokens", "output_tokens", "total_tokens"):
        assert final["usage"][count] == whole["usage"][count]  # cached_tokens may differ
    assert events[0]["response"]["status"] == "in_progress"
    stored = _get(app, f"/v1/responses/{final['id']}")  # a streamed response is kept too
    assert stored.status_code == 200 and stored.json() == final


def test_previous_response_id_continues_the_stored_conversation(app: Any) -> None:
    first = _post(app, "/v1/responses", {"input": "One", "instructions": "Sys", **GREEDY}).json()
    answer = first["output"][0]["content"][0]["text"]
    second = _post(
        app,
        "/v1/responses",
        {"input": "Two", "previous_response_id": first["id"], **GREEDY},
    ).json()
    history = [
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Two"},
    ]  # the first request's instructions are not carried over
    chat = _chat(app, messages=history, temperature=0.0, max_tokens=5)
    assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert second["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert second["previous_response_id"] == first["id"]
    unstored = _post(app, "/v1/responses", {"input": "x", "store": False, **GREEDY}).json()
    missing = _post(app, "/v1/responses", {"input": "x", "previous_response_id": unstored["id"]})
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "previous_response_id"


def test_a_named_function_gives_a_function_call_item(app: Any) -> None:
    body = {
        "input": "Weather in Oslo?",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 0.0,
        "max_output_tokens": 40,
    }
    whole = _post(app, "/v1/responses", body).json()
    (call,) = [item for item in whole["output"] if item["type"] == "function_call"]
    assert call["name"] == "get_weather" and call["call_id"]
    assert set(json.loads(call["arguments"])) == {"city"}
    events = _events(_post(app, "/v1/responses", {**body, "stream": True}))
    kinds = [event["type"] for event in events]
    assert "response.function_call_arguments.delta" in kinds
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == call["arguments"] and done["name"] == "get_weather"
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call["arguments"]
    assert kinds[-1] == "response.completed"


def test_text_format_json_schema_constrains_the_answer(app: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 5}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    body = {
        "input": "Answer in JSON",
        "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}},
        "temperature": 0.0,
        "max_output_tokens": 40,
    }
    response = _post(app, "/v1/responses", body).json()
    text = response["output"][0]["content"][0]["text"]
    assert text.startswith("{")  # the random model may run on in whitespace; the chat too:
    chat = _chat(
        app,
        messages=[{"role": "user", "content": "Answer in JSON"}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        temperature=0.0,
        max_tokens=40,
    )
    assert text == chat["choices"][0]["message"]["content"]
    assert response["text"] == body["text"]


def test_refusals_are_openai_errors(app: Any) -> None:
    for body, param in [
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"input": "x", "model": "other"}, "model"),
        ({"input": "x", "tools": [TOOL]}, "tool_choice"),  # "auto" needs the parser
    ]:
        response = _post(app, "/v1/responses", body)
        assert response.status_code in (400, 404), body
        assert response.json()["error"]["param"] == param, response.json()


# ---------------------------------------------------------------- reasoning items
def _think(text: str, final: bool) -> ReasoningSplit:
    """A reasoning parser for ``<think>...</think>`` answers (the route's hook)."""
    reasoning, end, content = text.removeprefix("<think>").partition("</think>")
    if not end:  # hold back what may still become </think>
        held = next((n for n in range(8, 0, -1) if reasoning.endswith("</think>"[:n])), 0)
        return ReasoningSplit(reasoning[: len(reasoning) - held], "")
    return ReasoningSplit(reasoning, content)


def _completion(text: str, finish_reason: str | None) -> Completion:
    return Completion(0, text, list(range(len(text))), finish_reason, None, None)


def test_reasoning_becomes_its_own_item_whole_and_streamed() -> None:
    shape = ResponseShape("resp_x", "m", ResponsesRequest.model_validate({"input": "hi"}))
    prompt = Prompt("hi", [1, 2, 3], None)
    texts = [
        "<think>Let",
        "<think>Let me</thi",
        "<think>Let me</think>\nHel",
        "<think>Let me</think>\nHello",
    ]
    events = ResponseEvents(shape, None, _think)
    bodies = [json.loads(e.split("\ndata: ")[1]) for e in events.started()]
    for index, text in enumerate(texts):
        last = index == len(texts) - 1
        for raw in events.advance(_completion(text, "stop" if last else None)):
            bodies.append(json.loads(raw.split("\ndata: ")[1]))
    bodies += [
        json.loads(e.split("\ndata: ")[1])
        for e in events.finished(prompt, _completion(texts[-1], "stop"))
    ]
    kinds = [body["type"] for body in bodies]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    reasoning = "".join(b["delta"] for b in bodies if b["type"] == "response.reasoning_text.delta")
    answer = "".join(b["delta"] for b in bodies if b["type"] == "response.output_text.delta")
    assert (reasoning, answer) == ("Let me", "\nHello")
    assert [b["output_index"] for b in bodies if b["type"] == "response.output_item.added"] == [
        0,
        1,
    ]
    whole = response_body(shape, prompt, _completion(texts[-1], "stop"), None, _think)
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me"}]
    assert whole["output"][1]["content"][0]["text"] == "\nHello"
    final = bodies[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == whole["output"][0]["content"]
    # The next turn gets the reasoning as the assistant message's reasoning_content.
    assert assistant_message(whole["output"]) == {
        "role": "assistant",
        "content": "\nHello",
        "reasoning_content": "Let me",
    }


def test_an_answer_cut_mid_thought_is_one_reasoning_item() -> None:
    shape = ResponseShape("resp_y", "m", ResponsesRequest.model_validate({"input": "hi"}))
    prompt = Prompt("hi", [1, 2, 3], None)
    cut = _completion("<think>still thinking", "length")
    whole = response_body(shape, prompt, cut, None, _think, reasoning_tokens=21)
    assert [item["type"] for item in whole["output"]] == ["reasoning"]
    assert whole["status"] == "incomplete"
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 21}
    events = ResponseEvents(shape, None, _think)
    streamed = [*events.advance(_completion("<think>still", None)), *events.advance(cut)]
    assert not any('"type":"message"' in event for event in streamed)
    assert [item["type"] for item in events.output] == ["reasoning"]
