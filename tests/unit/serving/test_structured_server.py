"""Structured outputs and tool calling through ``pagedinfer serve`` with real clients (the
official ``openai`` client; LangChain when ``langchain-openai`` is installed).

The model has random weights: without the grammar its output is never valid JSON, let alone
valid under a schema, so every validation below is the grammar's doing. The server runs with
a Hermes-style chat template that renders tools and tool messages (as Qwen2.5's does),
``--tool-call-parser hermes --enable-auto-tool-choice``.

LangChain's test runs when ``langchain-openai`` is importable (``pip install
langchain-openai``; it is not a test dependency) and is skipped otherwise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from tests.unit.serving.conftest import MODEL_NAME, ServerProcess, start_server

from pagedinfer.cli import EXIT_USER_ERROR, main

# Qwen2.5's way of rendering tools and their history, in short.
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}{% for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time", "parameters": TIME_PARAMETERS},
    },
]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A nested schema: $ref/$defs, enums, integer ranges, string patterns, arrays with min/max
# items, required and optional properties.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "kind": {"enum": ["a", "b"]},
        "point": {"$ref": "#/$defs/Point"},
        "labels": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
            "minItems": 1,
            "maxItems": 3,
        },
        "flag": {"type": "boolean"},
    },
    "required": ["id", "kind", "point", "labels"],
    "additionalProperties": False,
    "$defs": {
        "Point": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -9, "maximum": 9},
                "y": {"type": "integer", "minimum": -9, "maximum": 9},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    celsius: int = Field(ge=-40, le=50)
    sky: list[Literal["sun", "rain", "wind"]] = Field(min_length=1, max_length=3)
    note: str = Field(max_length=8)


@pytest.fixture(scope="module")
def server(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    directory = tmp_path_factory.mktemp("structured")
    template = directory / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    args = ["--chat-template", str(template)]
    args += ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    process = start_server(chat_checkpoint, directory / "server.log", args=args)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body}, timeout=120)


# ------------------------------------------------------------------- structured outputs
def test_parse_with_a_pydantic_model_returns_the_parsed_object(client: openai.OpenAI) -> None:
    """``client.chat.completions.parse(response_format=Model)``: the client sends the model's
    strict JSON schema and parses the answer into the model (it raises on anything else)."""
    # chat.completions.parse in openai >= 1.92, beta.chat.completions.parse before.
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for seed in (1, 2):
        completion = parse(
            model=MODEL_NAME,
            messages=ASK,
            response_format=Forecast,
            max_tokens=300,
            seed=seed,
            extra_body=COMPACT,
        )
        (choice,) = completion.choices
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Forecast)
        assert Forecast.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_outputs_validate(client: openai.OpenAI, stream: bool) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    body: dict[str, Any] = {"response_format": response_format, **COMPACT}
    texts = ["", "", ""]
    reasons: list[str | None] = [None, None, None]
    if stream:
        for chunk in client.completions.create(
            model=MODEL_NAME, prompt="A thing:", n=3, seed=5, max_tokens=300, stream=True,
            extra_body=body,
        ):  # fmt: skip
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    else:
        response = client.completions.create(
            model=MODEL_NAME, prompt="A thing:", n=3, seed=5, max_tokens=300, extra_body=body
        )
        texts = [choice.text for choice in response.choices]
        reasons = [choice.finish_reason for choice in response.choices]
    assert reasons == ["stop"] * 3
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # seeded completions differ: the schema does not fix them


def test_json_object_in_chat(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=60,
        seed=3,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    (choice,) = reply.choices
    if choice.finish_reason == "stop":  # an object may take more than 60 tokens
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")


@pytest.mark.parametrize(
    ("fields", "valid"),
    [
        (
            {"guided_regex": r"[a-z]{2,5}-[0-9]{1,3}"},
            re.compile(r"[a-z]{2,5}-[0-9]{1,3}").fullmatch,
        ),
        ({"guided_choice": ["yes", "no", "maybe"]}, {"yes", "no", "maybe"}.__contains__),
        (
            {"guided_grammar": 'root ::= item ("," item)?\nitem ::= [a-c] [a-c]?'},
            re.compile(r"[a-c]{1,2}(,[a-c]{1,2})?").fullmatch,
        ),
        (
            {"structured_outputs": {"grammar": 'start: "<" WORD ">"\nWORD: /[xyz]{1,3}/'}},
            re.compile(r"<[xyz]{1,3}>").fullmatch,
        ),
        (
            {
                "guided_json": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                }
            },
            lambda text: len(json.loads(text)) == 2,
        ),
    ],
)
def test_vllms_fields_constrain_completions_and_chat(
    client: openai.OpenAI, fields: dict[str, Any], valid: Any
) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt="Answer:", n=2, seed=9, max_tokens=40, extra_body=fields
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop" and valid(choice.text), choice.text
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, seed=9, max_tokens=40, extra_body=fields
    )
    assert reply.choices[0].finish_reason == "stop"
    assert valid(reply.choices[0].message.content), reply.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": "x", "guided_regex": "(unclosed"}, "guided_regex", "guided_regex"),
        (
            {
                "prompt": "x",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"$ref": "#/$defs/Missing"}},
                },
            },
            "response_format",
            "response_format",
        ),
        ({"prompt": "x", "guided_choice": "yes"}, "guided_choice", "list"),
        ({"prompt": "x", "guided_regex": "a", "ignore_eos": True}, "ignore_eos", "ignore_eos"),
        (
            {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "both constrain",
        ),
    ],
)
def test_a_constraint_that_cannot_be_served_is_a_400_naming_the_field(
    server: ServerProcess, body: dict[str, Any], param: str, message: str
) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = _post(server, path, {"max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


# ---------------------------------------------------------------------------- tool calls
def _calls(message: Any) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def test_required_calls_validate_against_their_functions(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", n=4, seed=11,
        max_tokens=200,
    )  # fmt: skip
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    single = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", n=4, seed=11,
        max_tokens=200, parallel_tool_calls=False,
    )  # fmt: skip
    assert all(len(choice.message.tool_calls) == 1 for choice in single.choices)
    # The round trip a client makes: the call back in the history, then the tool's answer.
    message = single.choices[0].message
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21 degrees"},
    ]
    follow_up = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none", max_tokens=3
    )
    assert follow_up.choices[0].message.tool_calls is None


def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        n=3,
        seed=4,
        max_tokens=100,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"  # OpenAI's and vLLM's for a named function
        ((name, arguments),) = _calls(choice.message)
        assert name == "get_time"
        jsonschema.validate(json.loads(arguments), TIME_PARAMETERS)


def _streamed(client: openai.OpenAI, **body: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """A streamed chat, put back together as a client does; checks OpenAI's delta shape."""
    content = ""
    calls: dict[int, list[str]] = {}
    reason = None
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True, **body):
        for choice in chunk.choices:
            delta = choice.delta
            assert delta.role or delta.content or delta.tool_calls or choice.finish_reason
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = [delta.function.name, delta.function.arguments or ""]
                else:
                    assert delta.id is None and delta.function.name is None
                    calls[delta.index][1] += delta.function.arguments
    return content, [(name, arguments) for name, arguments in calls.values()], reason


# A tool call the Hermes parser reads, forced with a regex (the model is random).
HERMES_CALL = (
    r'I will check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": '
    r'"(Paris|Rome)", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>'
)


@pytest.mark.parametrize(
    "choice",
    [
        "required",
        {"type": "function", "function": {"name": "get_weather"}},
        "auto",
    ],
)
def test_streamed_tool_calls_add_up_to_the_whole_answer(client: openai.OpenAI, choice: Any) -> None:
    body: dict[str, Any] = {
        "messages": ASK, "tools": TOOLS, "tool_choice": choice, "temperature": 0.0,
        "max_tokens": 200,
    }  # fmt: skip
    if choice == "auto":  # the auto path: the server's parser reads the model's text
        body["extra_body"] = {"structured_outputs": {"regex": HERMES_CALL}}
    whole = client.chat.completions.create(model=MODEL_NAME, **body).choices[0]
    content, calls, reason = _streamed(client, **body)
    assert calls == _calls(whole.message) and calls
    assert content == (whole.message.content or "")
    assert reason == whole.finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls")
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    if choice == "auto":
        assert whole.message.content == "I will check."


def test_tools_and_their_history_reach_the_template(server: ServerProcess) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    body = {"messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1}
    response = _post(server, "/v1/chat/completions", {**body, "return_prompt_text": True})
    assert response.status_code == 200, response.text
    prompt = response.json()["prompt_text"]
    assert json.dumps(TOOLS[0]) in prompt  # the tools, as the template writes them
    # The call's arguments reached the template as an object (HF templates expect one).
    assert '"arguments": {"city": "Rome", "unit": "celsius"}}' in prompt
    assert "<tool_response>\n21 degrees\n</tool_response>" in prompt
    tokenized = _post(server, "/tokenize", {"messages": messages, "tools": TOOLS})
    assert tokenized.status_code == 200, tokenized.text
    bad = dict(call, function={"name": "get_weather", "arguments": "{not json"})
    history = [*ASK, {"role": "assistant", "tool_calls": [bad]}]
    refused = _post(server, "/v1/chat/completions", {**body, "messages": history})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


def test_auto_tool_choice_needs_the_servers_parser(tmp_path: Path) -> None:
    """vLLM's rule: --enable-auto-tool-choice needs --tool-call-parser (a user error at start,
    before any model loads)."""
    assert main(["serve", str(tmp_path), "--enable-auto-tool-choice"]) == EXIT_USER_ERROR


# ----------------------------------------------------------------------------- LangChain
def test_langchain_structured_output_and_tools(server: ServerProcess) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(
        model=MODEL_NAME,
        base_url=server.api_url,
        api_key="unused",
        temperature=0,
        max_tokens=300,
        max_retries=0,
        extra_body=COMPACT,
    )
    for method in ("json_schema", "function_calling"):  # response_format / a named tool
        forecast = model.with_structured_output(Forecast, method=method).invoke("Weather?")
        assert isinstance(forecast, Forecast)

    def get_weather(
        city: Literal["Paris", "Rome", "Oslo"], unit: Literal["celsius", "fahrenheit"]
    ) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    tools_model = langchain_openai.ChatOpenAI(
        model=MODEL_NAME, base_url=server.api_url, api_key="unused", temperature=0,
        max_tokens=200, max_retries=0,
    )  # fmt: skip
    message = tools_model.bind_tools([get_weather], tool_choice="required").invoke("Weather?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["city"] in {"Paris", "Rome", "Oslo"}
