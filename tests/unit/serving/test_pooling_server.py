"""``pagedinfer serve DIR --runner pooling``: /v1/embeddings through the openai client
(float and base64), /score and /rerank, against the engine's own embeddings; generation
routes refused with a 400 naming the runner."""

from __future__ import annotations

import base64
import signal
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagedinfer import LLM

from .conftest import ENGINE_KWARGS, ServerProcess, start_server

SMALL: dict[str, Any] = {"num_kv_blocks": 64, "max_model_len": 256, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("pooling-server") / "server.log"
    server = start_server(checkpoint, log_path, runner="pooling", **SMALL)
    try:
        yield server
    finally:
        if server.process.poll() is None:
            server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> Iterator[LLM]:
    options = {**ENGINE_KWARGS, **SMALL}
    with LLM(model=checkpoint, runner="pooling", **options) as llm:
        yield llm


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_openai_client_embeddings_equal_the_engines(server: ServerProcess, llm: LLM) -> None:
    client = openai.OpenAI(base_url=server.api_url, api_key="none")
    texts = ["hello world", "a longer text about something else entirely"]
    expected = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    # The client asks for base64 unless told otherwise, and decodes it.
    response = client.embeddings.create(model="tiny-chat", input=texts)
    assert [item.index for item in response.data] == [0, 1]
    for item, vector in zip(response.data, expected, strict=True):
        assert item.embedding == pytest.approx(vector, abs=1e-5)
    tokens = sum(len(o.prompt_token_ids) for o in llm.embed(texts, use_tqdm=False))
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    floats = client.embeddings.create(model="tiny-chat", input=[5, 6, 7], encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(
        llm.embed([[5, 6, 7]], use_tqdm=False)[0].outputs.embedding, abs=1e-5
    )


def test_base64_is_little_endian_float32(server: ServerProcess, llm: LLM) -> None:
    body = {"input": [[1, 2, 3], [4, 5]], "encoding_format": "base64"}
    data = _post(server, "/v1/embeddings", body).json()["data"]
    expected = llm.embed([[1, 2, 3], [4, 5]], use_tqdm=False)
    for item, output in zip(data, expected, strict=True):
        raw = base64.b64decode(item["embedding"])
        vector = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert vector == pytest.approx(output.outputs.embedding, abs=1e-6)


def test_score_and_rerank_shapes(server: ServerProcess, llm: LLM) -> None:
    documents = ["the cat", "hello world", "something"]
    expected = [o.outputs.score for o in llm.score("hello world", documents, use_tqdm=False)]
    scored = _post(server, "/score", {"text_1": "hello world", "text_2": documents}).json()
    assert [item["index"] for item in scored["data"]] == [0, 1, 2]
    assert [item["score"] for item in scored["data"]] == pytest.approx(expected, abs=1e-5)
    assert scored["data"][1]["score"] == pytest.approx(1.0, abs=1e-5)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"query": "hello world", "documents": documents, "top_n": 2}
        results = _post(server, path, body).json()["results"]
        assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -expected[i])[:2]
        assert results[0]["document"] == {"text": "hello world"}
        assert results[0]["relevance_score"] == pytest.approx(1.0, abs=1e-5)


def test_generation_routes_refuse_a_pooling_model(server: ServerProcess) -> None:
    response = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 400
    assert "pooling model" in response.json()["error"]["message"]
    response = _post(server, "/v1/embeddings", {"input": "hi", "dimensions": 8})
    assert response.status_code == 400 and "Matryoshka" in response.json()["error"]["message"]
    assert _post(server, "/v1/embeddings", {"input": []}).status_code == 400
