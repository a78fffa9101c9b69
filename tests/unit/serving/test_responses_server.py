"""``/v1/responses`` through the official ``openai`` client's ``responses`` API against a real
``pagedinfer serve`` process (one server for the module, the tiny random checkpoint)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from tests.unit.serving.conftest import MODEL_NAME, ServerProcess

GREEDY: dict[str, Any] = {"temperature": 0.0, "max_output_tokens": 6}
TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=60)


def test_create_and_retrieve(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL_NAME, input="Hello there", **GREEDY)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hello there"}],
        temperature=0.0,
        max_tokens=6,
    )
    assert response.object == "response" and response.model == MODEL_NAME
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_stream_events_add_up_to_the_response(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL_NAME, input="Tell me a story", **GREEDY)
    events = list(
        client.responses.create(model=MODEL_NAME, input="Tell me a story", stream=True, **GREEDY)
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    for kind in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert kinds.count(kind) == 1, kind
    assert kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # The client's stream helper checks the events' order as it accumulates them.
    with client.responses.stream(model=MODEL_NAME, input="Tell me a story", **GREEDY) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text


def test_function_calls_and_their_outputs(client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    response = client.responses.create(
        model=MODEL_NAME,
        input=question,  # type: ignore[arg-type]
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice=NAMED,  # type: ignore[arg-type]
        temperature=0.0,
        max_output_tokens=40,
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    with client.responses.stream(
        model=MODEL_NAME,
        input=question,  # type: ignore[arg-type]
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice=NAMED,  # type: ignore[arg-type]
        temperature=0.0,
        max_output_tokens=40,
    ) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    (streamed_call,) = [item for item in streamed.output if item.type == "function_call"]
    assert streamed_call.arguments == call.arguments
    # The agent loop: the call and its output go back as input.
    follow_up = client.responses.create(
        model=MODEL_NAME,
        input=[
            *question,
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],  # type: ignore[list-item]
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice="none",
        **GREEDY,
    )
    assert follow_up.output[0].type == "message"
    # The same turn continued from the stored response.
    continued = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice="none",
        **GREEDY,
    )
    assert continued.output_text == follow_up.output_text
    assert continued.usage is not None and follow_up.usage is not None
    assert continued.usage.input_tokens == follow_up.usage.input_tokens


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 4}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL_NAME,
        input="JSON please",
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        temperature=0.0,
        max_output_tokens=60,
    )
    assert response.output_text.startswith("{")
    if response.status == "completed":
        assert set(json.loads(response.output_text)) == {"answer"}


def test_what_is_not_served_is_a_400_naming_it(client: openai.OpenAI) -> None:
    for extra, param in [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ]:
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(model=MODEL_NAME, input="hi", **extra)  # type: ignore[arg-type]
        assert isinstance(error.value.body, dict) and error.value.body["param"] == param
