"""``pagedinfer serve`` driven by the official ``openai`` client (and raw HTTP where the client
hides what is tested): completions and chat, streamed and not, equal to ``Engine.generate``;
64 concurrent streams; bad input; a client that disconnects; metrics; shutdown.

One server process serves the whole module (starting one costs seconds); the shutdown test
runs last and stops it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psutil
import pytest
from tests.unit.serving.conftest import MODEL_NAME, ServerProcess

from pagedinfer import Engine, RequestOutput, SamplingParams

PROMPTS = ["Hello, world!", "The quick brown fox", "paged attention", "Once upon a time"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference_engine(server: ServerProcess) -> Iterator[Engine]:
    """The same checkpoint and settings as the server, driven offline."""
    with Engine(server.checkpoint, **server.engine_kwargs) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=60)


def _greedy(**fields: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)


def _offline(engine: Engine, prompts: list[Any], **fields: Any) -> list[RequestOutput]:
    return engine.generate(prompts, _greedy(**fields), use_tqdm=False)


def _chat_ids(engine: Engine, content: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


GREEDY_BODY: dict[str, Any] = {
    "temperature": 0.0,
    "max_tokens": MAX_TOKENS,
    "extra_body": {"ignore_eos": True, "return_token_ids": True},
}


# ------------------------------------------------------------------------- basics
def test_health_and_models(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(server.base_url + "/health").status_code == 200
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL_NAME]


def test_completions_equal_engine_generate(client: openai.OpenAI, reference_engine: Engine) -> None:
    expected = _offline(reference_engine, [*PROMPTS, [5, 6, 7, 8]])
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, **GREEDY_BODY)
    assert [choice.index for choice in response.choices] == list(range(len(PROMPTS)))
    for choice, want in zip(response.choices, expected, strict=False):
        assert choice.text == want.outputs[0].text
        assert choice.model_extra["token_ids"] == want.outputs[0].token_ids
        assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected[:4])
    assert response.usage.completion_tokens == 4 * MAX_TOKENS
    by_ids = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7, 8], **GREEDY_BODY)
    assert by_ids.choices[0].model_extra["token_ids"] == expected[4].outputs[0].token_ids


def test_streamed_completion_equals_the_whole(
    client: openai.OpenAI, reference_engine: Engine
) -> None:
    (want,) = _offline(reference_engine, [PROMPTS[1]])
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[1],
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY_BODY,
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
    text_chunks = [chunk for chunk in chunks if chunk.choices]
    assert "".join(chunk.choices[0].text for chunk in text_chunks) == want.outputs[0].text
    tokens = [t for chunk in text_chunks for t in chunk.choices[0].model_extra["token_ids"]]
    assert tokens == want.outputs[0].token_ids
    assert [chunk.choices[0].finish_reason for chunk in text_chunks][-1] == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in text_chunks[:-1])


def test_streamed_completion_of_several_prompts_keeps_choices_apart(
    client: openai.OpenAI, reference_engine: Engine
) -> None:
    expected = _offline(reference_engine, PROMPTS[:3])
    texts = ["", "", ""]
    reasons: list[str | None] = [None, None, None]
    for chunk in client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[:3], stream=True, **GREEDY_BODY
    ):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [want.outputs[0].text for want in expected]
    assert reasons == ["length"] * 3


def test_chat_equals_engine_generate_on_the_template(
    client: openai.OpenAI, reference_engine: Engine
) -> None:
    (want,) = _offline(reference_engine, [_chat_ids(reference_engine, "Hi there")])
    messages = [{"role": "user", "content": "Hi there"}]
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY_BODY)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want.outputs[0].text
    assert choice.model_extra["token_ids"] == want.outputs[0].token_ids
    assert response.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, stream=True, **GREEDY_BODY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_completions_with_logprobs_equal_engine_generate(
    client: openai.OpenAI, reference_engine: Engine
) -> None:
    fields = {"n": 2, "seed": 9, "logprobs": 2}
    (want,) = reference_engine.generate(
        [PROMPTS[2]],
        SamplingParams(max_tokens=6, ignore_eos=True, **fields),  # type: ignore[arg-type]
        use_tqdm=False,
    )
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[2],
        max_tokens=6,
        n=2,
        seed=9,
        logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [choice.index for choice in response.choices] == [0, 1]
    for choice, completion in zip(response.choices, want.outputs, strict=True):
        assert choice.model_extra["token_ids"] == completion.token_ids
        assert choice.logprobs is not None and completion.logprobs is not None
        expected = [
            entries[t].logprob
            for t, entries in zip(completion.token_ids, completion.logprobs, strict=True)
        ]
        assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-5)
        # The top 2 and the sampled token, keyed by text (tokens with equal text share a key).
        assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)


def test_stop_string_streamed_and_whole_agree(
    client: openai.OpenAI, reference_engine: Engine
) -> None:
    (free,) = _offline(reference_engine, [PROMPTS[0]])
    stop = free.outputs[0].text[len(free.outputs[0].text) // 2 : len(free.outputs[0].text) // 2 + 2]
    assert stop, free.outputs[0].text
    (want,) = _offline(reference_engine, [PROMPTS[0]], stop=[stop])
    body = {**GREEDY_BODY, "stop": [stop]}
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **body)
    assert (
        whole.choices[0].text == want.outputs[0].text and whole.choices[0].finish_reason == "stop"
    )
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], stream=True, **body)
    assert "".join(chunk.choices[0].text for chunk in streamed) == want.outputs[0].text


# ----------------------------------------------------- n > 1, logprobs, stop reasons, echo
CHAT = [{"role": "user", "content": "Tell me a story"}]


def _logprob_values(completion: Any) -> list[float]:
    return [
        entries[token].logprob
        for token, entries in zip(completion.token_ids, completion.logprobs, strict=True)
    ]


def _top_values(entries: dict[int, Any], k: int) -> list[float]:
    return [e.logprob for e in sorted(entries.values(), key=lambda e: e.rank) if e.rank <= k]


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
def test_chat_n_with_logprobs_equals_engine_chat(
    client: openai.OpenAI, reference_engine: Engine, seed: int | None
) -> None:
    sampling: dict[str, Any] = {"temperature": 0.0} if seed is None else {"seed": seed}
    params = SamplingParams(n=2, max_tokens=6, ignore_eos=True, logprobs=3, **sampling)
    (want,) = reference_engine.chat(CHAT, params, use_tqdm=False)
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,  # type: ignore[arg-type]
        n=2,
        max_completion_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        **sampling,
    )
    assert [choice.index for choice in response.choices] == [0, 1]
    for choice, completion in zip(response.choices, want.outputs, strict=True):
        assert choice.model_extra["token_ids"] == completion.token_ids
        assert choice.message.content == completion.text
        assert choice.finish_reason == "length" and choice.model_extra["stop_reason"] is None
        content = choice.logprobs.content
        assert [entry.logprob for entry in content] == pytest.approx(
            _logprob_values(completion), abs=1e-5
        )
        for entry, token_id, entries in zip(
            content, completion.token_ids, completion.logprobs, strict=True
        ):
            assert entry.token == entries[token_id].decoded_token
            assert entry.bytes == list(entry.token.encode())
            assert len(entry.top_logprobs) == 3
            assert [top.logprob for top in entry.top_logprobs] == pytest.approx(
                _top_values(entries, 3), abs=1e-5
            )
    if seed is None:  # greedy: both completions are the one greedy continuation
        assert response.choices[0].message.content == response.choices[1].message.content
    assert response.usage.prompt_tokens == len(want.prompt_token_ids)  # counted once
    assert response.usage.completion_tokens == 2 * 6


def _stop_for_choice_0(texts: list[str]) -> str:
    """Two characters from the middle of the first text that the second text lacks."""
    first, second = texts
    for start in range(len(first) // 3, len(first) - 2):
        stop = first[start : start + 2]
        if stop.strip() and "\ufffd" not in stop and stop not in second:
            return stop
    pytest.skip(f"no stop string only in the first text: {texts}")


def _reassemble(chunks: list[Any], chat: bool) -> dict[int, dict[str, Any]]:
    """Per choice index: text, token ids, logprobs, the finish chunks seen, stop_reason."""
    choices: dict[int, dict[str, Any]] = {}
    for number, chunk in enumerate(chunks):
        for choice in chunk.choices:
            state = choices.setdefault(
                choice.index,
                {"text": "", "tokens": [], "logprobs": [], "finishes": [], "last": 0},
            )
            state["last"] = number
            state["text"] += (choice.delta.content or "") if chat else choice.text
            state["tokens"] += choice.model_extra["token_ids"]
            if chat:
                state["logprobs"] += [e.logprob for e in choice.logprobs.content]
            else:
                state["logprobs"] += choice.logprobs.token_logprobs
                state.setdefault("offsets", []).extend(choice.logprobs.text_offset)
            if choice.finish_reason is not None:
                state["finishes"].append(number)
                state["finish_reason"] = choice.finish_reason
                state["stop_reason"] = choice.model_extra["stop_reason"]
    return choices


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_n_completions_reassembled_equal_the_whole(
    client: openai.OpenAI, reference_engine: Engine, chat: bool
) -> None:
    """n=2 (and two prompts for completions), seeded, with logprobs; one choice ends early
    on a stop string while the other runs on: each choice's chunks add up to its whole,
    each ends once with its own finish_reason, and usage counts agree."""
    fields: dict[str, Any] = {"n": 2, "seed": 11, "max_tokens": 10}
    extra = {"ignore_eos": True, "return_token_ids": True}
    prompts = PROMPTS[:2]
    if chat:
        fields |= {"logprobs": True, "top_logprobs": 1}

        def create(**more: Any) -> Any:
            return client.chat.completions.create(
                model=MODEL_NAME,
                messages=CHAT,  # type: ignore[arg-type]
                extra_body=extra,
                **fields,
                **more,
            )

        def text_of(choice: Any) -> str:
            return str(choice.message.content)
    else:
        fields |= {"logprobs": 1}

        def create(**more: Any) -> Any:
            return client.completions.create(
                model=MODEL_NAME, prompt=prompts, extra_body=extra, **fields, **more
            )

        def text_of(choice: Any) -> str:
            return str(choice.text)

    free = create()
    stop = _stop_for_choice_0([text_of(choice) for choice in free.choices[:2]])
    whole = create(stop=[stop])
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].model_extra["stop_reason"] == stop
    assert whole.choices[1].finish_reason == "length"
    assert len(whole.choices[0].model_extra["token_ids"]) < 10
    # The engine offline, with the same seed, gives the same completions.
    params = SamplingParams(stop=[stop], ignore_eos=True, n=2, seed=11, max_tokens=10, logprobs=1)
    offline = (
        reference_engine.chat(CHAT, params, use_tqdm=False)
        if chat
        else reference_engine.generate(prompts, params, use_tqdm=False)
    )
    wanted = [completion for output in offline for completion in output.outputs]
    assert [choice.model_extra["token_ids"] for choice in whole.choices] == [
        completion.token_ids for completion in wanted
    ]
    assert [text_of(choice) for choice in whole.choices] == [c.text for c in wanted]

    chunks = list(create(stop=[stop], stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1]
    assert not usage.choices and usage.usage == whole.usage
    streamed = _reassemble(chunks[:-1], chat)
    assert sorted(streamed) == [choice.index for choice in whole.choices]
    for choice in whole.choices:
        got = streamed[choice.index]
        assert got["text"] == text_of(choice)
        assert got["tokens"] == choice.model_extra["token_ids"]
        logprobs = (
            [e.logprob for e in choice.logprobs.content] if chat else choice.logprobs.token_logprobs
        )
        assert got["logprobs"] == pytest.approx(logprobs, abs=1e-6)
        if not chat:
            assert got["offsets"] == choice.logprobs.text_offset
        assert got["finishes"] == [got["last"]]  # once, in the choice's last chunk
        assert (got["finish_reason"], got["stop_reason"]) == (
            choice.finish_reason,
            choice.model_extra["stop_reason"],
        )
    # The choice that stopped early ended before the other.
    assert streamed[0]["last"] < streamed[1]["last"]
    n_prompts = 1 if chat else 2
    assert whole.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline)
    assert whole.usage.completion_tokens == sum(len(c.token_ids) for c in wanted)
    assert len(whole.choices) == 2 * n_prompts


def test_stop_token_id_is_the_stop_reason(client: openai.OpenAI, reference_engine: Engine) -> None:
    (free,) = _offline(reference_engine, [PROMPTS[3]])
    stop_token = free.outputs[0].token_ids[3]
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[3],
        **{
            **GREEDY_BODY,
            "extra_body": {**GREEDY_BODY["extra_body"], "stop_token_ids": [stop_token]},
        },
    )
    (choice,) = response.choices
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_token
    index = free.outputs[0].token_ids.index(stop_token)
    assert choice.model_extra["token_ids"] == free.outputs[0].token_ids[: index + 1]


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_returns_the_prompt_with_its_logprobs(
    client: openai.OpenAI, reference_engine: Engine, max_tokens: int
) -> None:
    prompt = PROMPTS[1]
    (want,) = reference_engine.generate(
        [prompt],
        SamplingParams(
            temperature=0.0, max_tokens=max(max_tokens, 1), logprobs=2, prompt_logprobs=2
        ),
        use_tqdm=False,
    )
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "temperature": 0.0}
    body |= {"max_tokens": max_tokens, "echo": True, "logprobs": 2}
    response = client.completions.create(**body, extra_body={"prompt_logprobs": 2})
    (choice,) = response.choices
    completion = want.outputs[0]
    generated = completion.text if max_tokens else ""
    assert choice.text == prompt + generated
    prompt_ids = want.prompt_token_ids
    tokens = choice.logprobs.token_logprobs
    assert len(tokens) == len(prompt_ids) + (len(completion.token_ids) if max_tokens else 0)
    assert tokens[0] is None and choice.logprobs.top_logprobs[0] is None
    expected = [
        entries[token].logprob
        for token, entries in zip(prompt_ids[1:], want.prompt_logprobs[1:], strict=True)
    ]
    if max_tokens:
        expected += _logprob_values(completion)
    assert tokens[1:] == pytest.approx(expected, abs=1e-5)
    assert choice.logprobs.text_offset[0] == 0
    # vLLM's prompt_logprobs: {token id: {logprob, rank, decoded_token}} per prompt token.
    vllm = choice.model_extra["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(prompt_ids)
    assert vllm[1][str(prompt_ids[1])]["logprob"] == pytest.approx(expected[0], abs=1e-5)
    assert response.usage.completion_tokens == (len(completion.token_ids) if max_tokens else 0)
    streamed = list(client.completions.create(**body, stream=True))
    assert "".join(chunk.choices[0].text for chunk in streamed) == choice.text
    assert [
        value for chunk in streamed for value in chunk.choices[0].logprobs.token_logprobs
    ] == pytest.approx(tokens, abs=1e-6)
    assert [
        offset for chunk in streamed for offset in chunk.choices[0].logprobs.text_offset
    ] == choice.logprobs.text_offset


# ---------------------------------------------------------------------- concurrency
def test_64_concurrent_streaming_clients(server: ServerProcess, reference_engine: Engine) -> None:
    """Text prompts, token-id prompts and chats at once; each equals its offline result."""
    texts = [f"{PROMPTS[i % 4]} {i}" for i in range(64)]
    prompts: list[Any] = [
        _chat_ids(reference_engine, text) if i % 3 == 0 else text for i, text in enumerate(texts)
    ]
    expected = _offline(reference_engine, prompts)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, list[int], str | None]:
        text, tokens, reason = "", [], None
        if i % 3 == 0:
            messages = [{"role": "user", "content": texts[i]}]
            chat = await client.chat.completions.create(
                model=MODEL_NAME, messages=messages, stream=True, **GREEDY_BODY
            )
            async for chunk in chat:
                text += chunk.choices[0].delta.content or ""
                tokens += chunk.choices[0].model_extra["token_ids"]
                reason = chunk.choices[0].finish_reason or reason
            return text, tokens, reason
        prompt = texts[i] if i % 3 == 1 else reference_engine.tokenizer.encode(texts[i])
        completion = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, stream=True, **GREEDY_BODY
        )
        async for chunk in completion:
            text += chunk.choices[0].text
            tokens += chunk.choices[0].model_extra["token_ids"]
            reason = chunk.choices[0].finish_reason or reason
        return text, tokens, reason

    async def main() -> list[tuple[str, list[int], str | None]]:
        http = openai.DefaultAsyncHttpxClient(
            limits=httpx.Limits(max_connections=128, max_keepalive_connections=128)
        )
        async with openai.AsyncOpenAI(
            base_url=server.api_url, api_key="unused", max_retries=0, timeout=120, http_client=http
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    for (text, tokens, reason), want in zip(results, expected, strict=True):
        assert tokens == want.outputs[0].token_ids
        assert text == want.outputs[0].text
        assert reason == "length"
    metrics = server.metrics()
    assert metrics["pagedinfer_num_requests_running"] == 0
    assert metrics["pagedinfer_kv_cache_usage_ratio"] == 0


# ------------------------------------------------------------------------- bad input
def _post(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(
        server.api_url + path,
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/completions", '{"prompt": "hi", "max_tokens": 4', 400, None),
        ("/completions", "[1, 2]", 400, None),
        ("/completions", {"max_tokens": 4}, 400, "prompt"),
        ("/completions", {"prompt": "hi", "top_p": 3.0}, 400, "top_p"),
        ("/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
        ("/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
        (
            "/completions",
            {"prompt": "hi", "stream": True, "prompt_logprobs": 1},
            400,
            "prompt_logprobs",
        ),
        ("/completions", {"prompt": [1, 99999]}, 400, None),
        ("/completions", {"prompt": ""}, 400, None),
        ("/completions", {"prompt": [1] * 3000}, 400, None),
        ("/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        # Sizes against the request limits (max_n=128), before anything is built from them.
        ("/completions", {"prompt": ["hi"] * 65, "n": 2}, 400, "prompt"),
        ("/completions", {"prompt": "hi", "n": 10**9}, 400, "n"),
        ("/completions", {"prompt": "hi", "stop": ["x"] * 65}, 400, "stop"),
        # Strict types (issue 21, item 5): no coercion.
        ("/completions", {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
        ("/completions", {"prompt": "hi", "n": "2"}, 400, "n"),
        ("/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
        ("/completions", {"prompt": [True, False]}, 400, "prompt"),
        ("/completions", {"prompt": "hi", "temperature": 1e39}, 400, "temperature"),
        ("/completions", {"prompt": "hi", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
        ("/chat/completions", {"messages": []}, 400, "messages"),
        ("/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages",
        ),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
            400,
            "top_logprobs",
        ),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "model": "m"},
            404,
            "model",
        ),
    ],
)
def test_bad_input_gets_openai_error_and_server_keeps_serving(
    server: ServerProcess, path: str, body: Any, status: int, param: str | None
) -> None:
    response = _post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    ok = _post(server, "/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_openai_client_raises_its_own_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL_NAME, prompt="hi", top_p=5.0)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL_NAME, prompt=[1] * 4000)


# --------------------------------------------------------------------- disconnects
def _wait_for(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize(("stream", "n"), [(True, 1), (False, 1), (True, 2)])
def test_client_that_disconnects_gets_its_request_aborted(
    server: ServerProcess, stream: bool, n: int
) -> None:
    before = server.metrics().get('pagedinfer_requests_finished_total{finish_reason="abort"}', 0)
    body = {
        "prompt": "a long story",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": stream,
        "n": n,
        "seed": 3,
    }
    if stream:
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", server.api_url + "/completions", json=body) as response,
        ):
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert server.metrics()["pagedinfer_kv_cache_usage_ratio"] > 0
        # Leaving the block closed the connection mid-stream.
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.api_url + "/completions", json=body, timeout=0.5)

    def aborted() -> bool:
        metrics = server.metrics()
        return (
            metrics.get('pagedinfer_requests_finished_total{finish_reason="abort"}', 0)
            == before + 1
            and metrics["pagedinfer_num_requests_running"] == 0
            and metrics["pagedinfer_kv_cache_usage_ratio"] == 0
        )

    _wait_for(aborted)
    assert server.metrics()["pagedinfer_generation_tokens_total"] > 0


# ------------------------------------------------------------------------- metrics
def test_metrics_report_the_engine_and_latencies(server: ServerProcess) -> None:
    metrics = server.metrics()
    for name in (
        "pagedinfer_num_requests_running",
        "pagedinfer_num_requests_waiting",
        "pagedinfer_kv_cache_usage_ratio",
        "pagedinfer_prefix_cache_hit_rate",
        "pagedinfer_num_preemptions_total",
        "pagedinfer_prompt_tokens_total",
        "pagedinfer_generation_tokens_total",
    ):
        assert name in metrics, sorted(metrics)
    assert metrics["pagedinfer_time_to_first_token_seconds_count"] > 0
    assert metrics["pagedinfer_inter_token_latency_seconds_count"] > 0
    assert metrics["pagedinfer_e2e_request_latency_seconds_count"] > 0
    assert metrics['pagedinfer_requests_rejected_total{status="400"}'] > 0
    assert 0 < metrics["pagedinfer_prefix_cache_hit_rate"] <= 1  # prompts repeat in this module


# ------------------------------------------------------------------------ shutdown
def test_shutdown_with_a_stream_in_flight_leaves_no_process(server: ServerProcess) -> None:
    process = psutil.Process(server.process.pid)
    family = [process, *process.children(recursive=True)]
    received: list[str] = []

    def read_stream() -> None:
        body = {"prompt": "shutdown", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream(
                "POST", server.api_url + "/completions", json=body, timeout=60
            ) as response:
                received.extend(line for line in response.iter_lines() if line)
        except httpx.HTTPError:
            received.append("<disconnected>")

    reader = threading.Thread(target=read_stream)
    reader.start()
    _wait_for(lambda: len(received) > 0)
    started = time.monotonic()
    assert server.stop(signal.SIGTERM, timeout=60) == 0, server.log()
    reader.join(timeout=60)
    assert not reader.is_alive()
    # The in-flight request was aborted at once, not run to its end: its stream ended
    # properly, with the abort as finish reason, well within the grace period.
    assert time.monotonic() - started < 5, server.log()
    assert received[-1] == "data: [DONE]", received[-3:]
    assert '"finish_reason":"abort"' in received[-2], received[-3:]
    for member in family:
        assert not member.is_running() or member.status() == psutil.STATUS_ZOMBIE, member
