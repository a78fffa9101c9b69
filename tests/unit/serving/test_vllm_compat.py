"""vLLM's OpenAI-server behaviours (issue 22, items 1 to 6), through the official ``openai``
client against a real ``pagedinfer serve`` process, ported from vLLM's entrypoint tests where
they exist (test_chat_echo.py, test_return_token_ids.py) and compared with the engine run
offline.

The server runs with ``--chat-template FILE`` (the tiny model's template plus Qwen3's
``enable_thinking`` switch and a documents section) and ``--trust-request-chat-template``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tests.unit.serving.conftest import MODEL_NAME, ServerProcess, start_server

from pagedinfer import Engine, SamplingParams, __version__

TEMPLATE = (
    "{%- if documents %}{{- '<docs>' }}{%- for doc in documents %}{{- doc['text'] }}"
    "{%- endfor %}{{- '</docs>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
CHAT = [{"role": "user", "content": "Tell me a story"}]
SAYING = "Here is a common saying about apple. An apple a day, keeps"
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module")
def server(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    directory = tmp_path_factory.mktemp("compat")
    template = directory / "template.jinja"
    template.write_text(TEMPLATE)
    args = ["--chat-template", str(template), "--trust-request-chat-template"]
    args += ["--enable-prompt-tokens-details"]  # usage.prompt_tokens_details
    args += ["--log-level", "info"]  # the start-up line
    process = start_server(chat_checkpoint, directory / "server.log", args=args)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> Iterator[Engine]:
    with Engine(server.checkpoint, **server.engine_kwargs) as engine:
        yield engine


def _template_ids(engine: Engine, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    text = engine.tokenizer.apply_chat_template(
        messages, chat_template=kwargs.pop("chat_template", TEMPLATE), tokenize=False, **kwargs
    )
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def _offline(engine: Engine, prompt: Any, **fields: Any) -> Any:
    params = SamplingParams(temperature=0.0, max_tokens=6, **fields)
    (output,) = engine.generate([prompt], params, use_tqdm=False)
    return output


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


# ------------------------------------------------------------------- chat rendering
def test_chats_use_the_servers_template_and_its_variables(
    client: openai.OpenAI, server: ServerProcess, reference: Engine
) -> None:
    plain = _template_ids(reference, CHAT, add_generation_prompt=True)
    no_thinking = _template_ids(reference, CHAT, add_generation_prompt=True, enable_thinking=False)
    docs = [{"title": "t", "text": "Paged attention"}]
    with_docs = _template_ids(reference, CHAT, add_generation_prompt=True, documents=docs)
    assert len({tuple(plain), tuple(no_thinking), tuple(with_docs)}) == 3
    cases: list[tuple[dict[str, Any], list[int]]] = [
        ({}, plain),
        ({"chat_template_kwargs": {"enable_thinking": False}}, no_thinking),
        ({"reasoning_effort": "none"}, no_thinking),  # vLLM turns thinking off for it
        ({"documents": docs}, with_docs),
    ]
    for extra, expected in cases:
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            **GREEDY,
            extra_body={"return_token_ids": True, **extra},
        )
        assert response.prompt_token_ids == expected, extra
        want = _offline(reference, expected)
        assert response.choices[0].message.content == want.outputs[0].text
    tokenized = _post(server, "/tokenize", {"messages": CHAT}).json()
    assert tokenized["tokens"] == plain and tokenized["count"] == len(plain)


def test_a_template_sent_with_the_request_is_used_on_a_trusting_server(
    client: openai.OpenAI, reference: Engine
) -> None:
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        **GREEDY,
        extra_body={"chat_template": own, "return_token_ids": True},
    )
    expected = _template_ids(reference, CHAT, chat_template=own)
    assert response.prompt_token_ids == expected


@pytest.mark.parametrize("echo", [True, False])
def test_chat_echo_with_continue_final_message(
    client: openai.OpenAI, reference: Engine, echo: bool
) -> None:
    """vLLM's test_chat_session_with_echo_and_continue_final_message, compared offline."""
    messages = [
        {"role": "user", "content": "tell me a common saying"},
        {"role": "assistant", "content": SAYING},
    ]
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        **GREEDY,
        extra_body={
            "echo": echo,
            "continue_final_message": True,
            "add_generation_prompt": False,
            "return_token_ids": True,
        },
    )
    expected = _template_ids(
        reference, messages, add_generation_prompt=False, continue_final_message=True
    )
    assert reference.tokenizer.decode(expected).endswith(SAYING)  # the turn is left open
    assert response.prompt_token_ids == expected
    (choice,) = response.choices
    generated = _offline(reference, expected).outputs[0].text
    assert choice.message.role == "assistant"
    assert choice.message.content == (SAYING if echo else "") + generated
    streamed = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        **GREEDY,
        stream=True,
        extra_body={"echo": echo, "continue_final_message": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == choice.message.content


def test_continue_final_message_with_a_generation_prompt_is_refused(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )


# --------------------------------------------------------------------- token ids
def test_chat_streams_return_token_ids_and_the_prompts_first(
    client: openai.OpenAI, reference: Engine
) -> None:
    """vLLM's test_chat_completion_with_emoji_and_token_ids: the first chunk carries
    prompt_token_ids, the later ones do not; the chunks' token_ids add up to the whole."""
    whole = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        **GREEDY,
        extra_body={"return_token_ids": True},
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            **GREEDY,
            stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    assert all("prompt_token_ids" not in chunk.model_dump() for chunk in chunks[1:])
    tokens = [t for chunk in chunks for t in chunk.choices[0].token_ids]
    assert tokens == whole.choices[0].token_ids
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, **GREEDY)
    assert plain.prompt_token_ids is None
    assert plain.choices[0].token_ids is None


def test_tokens_as_token_ids_align_with_token_ids(client: openai.OpenAI) -> None:
    """vLLM's test_comparison_with_prompt_logprobs_and_logprobs."""
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello, world! How are you today?",
        max_tokens=8,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "prompt_logprobs": 1,
        },
    )
    (choice,) = completion.choices
    assert choice.logprobs is not None
    ids = [int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens]
    assert all(token.startswith("token_id:") for token in choice.logprobs.tokens)
    prompt_ids = choice.prompt_token_ids
    assert ids == prompt_ids + choice.token_ids
    assert choice.prompt_logprobs is not None
    for top in choice.logprobs.top_logprobs[1:]:
        assert all(key.startswith("token_id:") for key in top)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt="Tell me a short fact about Python:",
            max_tokens=8,
            temperature=0,
            stream=True,
            logprobs=1,
            extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
        )
    )
    assert chunks[0].choices[0].prompt_token_ids
    streamed = [t for c in chunks for t in c.choices[0].token_ids]
    named = [int(t.removeprefix("token_id:")) for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed == named and streamed
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        **GREEDY,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == [
        f"token_id:{t}" for t in chat.choices[0].token_ids
    ]
    assert all(top.token.startswith("token_id:") for e in content for top in e.top_logprobs)


def test_optional_fields_are_null_when_not_asked_for(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    choice = completion.choices[0]
    assert choice.token_ids is None and choice.prompt_token_ids is None
    assert choice.prompt_logprobs is None and choice.stop_reason is None
    assert completion.system_fingerprint is None
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=2,
    )
    assert chat.prompt_logprobs is None and chat.prompt_token_ids is None
    assert chat.choices[0].token_ids is None
    message = chat.choices[0].message
    assert message.refusal is None and message.reasoning is None
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens is not None


# ----------------------------------------------------------------------- truncation
def test_truncate_prompt_tokens_keeps_the_last_tokens(
    client: openai.OpenAI, server: ServerProcess, reference: Engine
) -> None:
    max_model_len = server.engine_kwargs["max_model_len"]
    long_ids = [(i * 7) % 400 + 10 for i in range(max_model_len + 100)]  # over the context
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=long_ids,
        **GREEDY,
        extra_body={"truncate_prompt_tokens": 50, "return_token_ids": True},
    )
    choice = response.choices[0]
    assert choice.prompt_token_ids == long_ids[-50:]
    assert response.usage is not None and response.usage.prompt_tokens == 50
    assert choice.text == _offline(reference, long_ids[-50:]).outputs[0].text
    right = client.completions.create(
        model=MODEL_NAME,
        prompt=long_ids,
        **GREEDY,
        extra_body={
            "truncate_prompt_tokens": 50,
            "truncation_side": "right",
            "return_token_ids": True,
        },
    )
    assert right.choices[0].prompt_token_ids == long_ids[:50]
    fits = client.completions.create(
        model=MODEL_NAME,
        prompt=long_ids,
        **GREEDY,
        extra_body={"truncate_prompt_tokens": -1, "return_token_ids": True},
    )
    kept = max_model_len - GREEDY["max_tokens"]
    assert fits.choices[0].prompt_token_ids == long_ids[-kept:]
    text = "The quick brown fox jumps over the lazy dog."
    by_text = client.completions.create(
        model=MODEL_NAME,
        prompt=text,
        echo=True,
        **GREEDY,
        extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True},
    )
    text_ids = list(reference.tokenizer.encode(text))
    assert by_text.choices[0].prompt_token_ids == text_ids[-3:]
    assert by_text.choices[0].text.startswith(reference.tokenizer.decode(text_ids[-3:]))
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        **GREEDY,
        extra_body={"truncate_prompt_tokens": 4, "return_token_ids": True},
    )
    plain = _template_ids(reference, CHAT, add_generation_prompt=True)
    assert chat.prompt_token_ids == plain[-4:]
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(
            model=MODEL_NAME,
            prompt="hi",
            **GREEDY,
            extra_body={"truncate_prompt_tokens": max_model_len},
        )


# ---------------------------------------------------------------------------- usage
def test_continuous_usage_stats_in_every_chunk(client: openai.OpenAI) -> None:
    for chat in (False, True):
        common: dict[str, Any] = {
            "model": MODEL_NAME,
            "temperature": 0.0,
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "extra_body": {"ignore_eos": True},
        }
        if chat:
            chunks = list(client.chat.completions.create(messages=CHAT, **common))
        else:
            chunks = list(client.completions.create(prompt="Once upon a time", **common))
        *deltas, final = chunks
        assert not final.choices and final.usage is not None and final.usage.completion_tokens == 5
        counts = [chunk.usage.completion_tokens for chunk in deltas]
        assert counts == sorted(counts) and counts[-1] == 5
        assert all(chunk.usage.prompt_tokens == final.usage.prompt_tokens for chunk in deltas)


def test_stream_options_without_a_stream_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(
            model=MODEL_NAME, prompt="hi", stream_options={"include_usage": True}
        )


def test_cached_tokens_and_the_prompt_token_counters(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    block = server.engine_kwargs["kv_block_size"]
    prompt = [(i * 13) % 300 + 20 for i in range(3 * block + 5)]  # seen by no other test
    before = server.metrics()
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == 3 * block  # every full block of the prompt
    after = server.metrics()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert grew("pagedinfer_prompt_tokens_total") == 2 * len(prompt)  # every prompt token
    assert grew("pagedinfer_prompt_tokens_cached_total") == cached
    assert grew("pagedinfer_prompt_tokens_computed_total") == 2 * len(prompt) - cached


# ------------------------------------------------------------------- fields, seeds
def test_fields_are_served_refused_or_unknown_never_dropped(client: openai.OpenAI) -> None:
    def create(**extra: Any) -> Any:
        return client.completions.create(
            model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body=extra
        )

    for field, value, message in [
        ("watermarking", True, "watermarking"),
        ("length_penalty", 0.5, "beam search only"),
        ("maxtokens", 3, "Unrecognized request argument supplied: maxtokens"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message) as error:
            create(**{field: value})
        assert error.value.body["param"] == field
    create(user="someone", use_beam_search=False, response_format={"type": "text"})
    with pytest.raises(openai.BadRequestError, match="send tools and tool_choice"):
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            functions=[{"name": "f", "parameters": {}}],
        )


def test_allowed_token_ids_restrict_the_output(client: openai.OpenAI) -> None:
    allowed = [11, 12, 13]
    response = client.completions.create(
        model=MODEL_NAME,
        prompt="hi",
        max_tokens=8,
        seed=3,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "return_token_ids": True},
    )
    tokens = response.choices[0].token_ids
    assert len(tokens) == 8 and set(tokens) <= set(allowed)


def test_signed_64_bit_seeds(client: openai.OpenAI) -> None:
    def tokens(seed: int) -> list[int]:
        response = client.completions.create(
            model=MODEL_NAME,
            prompt="Once upon",
            max_tokens=6,
            seed=seed,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return response.choices[0].token_ids

    assert tokens(-5) == tokens(2**63 - 5) == tokens(-5)
    assert tokens(-(2**63)) == tokens(0)
    tokens(-1)  # unseeded, as in vLLM
    with pytest.raises(openai.BadRequestError):
        tokens(2**63)


# ---------------------------------------------------------------------------- routes
def test_model_route_tokenize_detokenize_version(
    client: openai.OpenAI, server: ServerProcess, reference: Engine
) -> None:
    model = client.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.owned_by == "pagedinfer"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    text = "Hello, world!"
    tokenized = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    ids = list(reference.tokenizer.encode(text))
    assert tokenized == {
        "count": len(ids),
        "max_model_len": server.engine_kwargs["max_model_len"],
        "tokens": ids,
        "token_strs": reference.tokenizer.convert_ids_to_tokens(ids),
    }
    assert _post(server, "/tokenize", {"prompt": text}).json()["token_strs"] is None
    long_text = "word " * 3000  # /tokenize does not cap at max_model_len (as vLLM)
    assert _post(server, "/tokenize", {"prompt": long_text}).json()["count"] > 2048
    assert _post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": text}
    for body in ({"tokens": [10**6]}, {"tokens": [-1]}, {"prompt": "x", "frob": 1}):
        path = "/detokenize" if "tokens" in body else "/tokenize"
        refused = _post(server, path, body)
        assert refused.status_code == 400 and refused.json()["error"]["message"], body
    unknown_model = _post(server, "/tokenize", {"prompt": "x", "model": "other"})
    assert unknown_model.status_code == 404
    version = httpx.get(server.base_url + "/version", timeout=30).json()
    assert version == {"version": __version__}


def test_the_startup_line_names_what_runs(server: ServerProcess) -> None:
    kwargs = server.engine_kwargs
    line = next(line for line in server.log().splitlines() if "KV blocks" in line)
    for needle in (
        "device cpu",
        "dtype float32",
        "attention torch",
        f"{kwargs['num_kv_blocks']} KV blocks of {kwargs['kv_block_size']} tokens",
        f"max_model_len {kwargs['max_model_len']}",
        repr(MODEL_NAME),
    ):
        assert needle in line, line
    assert json.dumps(MODEL_NAME)
