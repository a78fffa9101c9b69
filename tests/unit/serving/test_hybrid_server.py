"""A real ``pagedinfer serve`` on a tiny Gemma 3 (sliding and global layers: KV groups).

Concurrent clients mix streamed and plain chat and completions requests with different
parameters (greedy, seeded sampling with top-p / top-k, ``n > 1``, logprobs, stop strings,
``max_tokens``, a JSON schema) on prompts several windows long that share a prefix, in a pool
small enough to preempt and with a token budget that chunks prefills; one client hangs up
mid-stream. The server must stay healthy, its greedy and seeded answers equal the same
requests sent alone afterwards, and once idle it runs and holds nothing: no request, KV usage
zero (the null block the groups hold for life does not count).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.unit.serving.conftest import MODEL_NAME, ServerProcess, start_server

GEMMA3 = {
    "architecture": "Gemma3ForCausalLM",
    "num_hidden_layers": 3,
    "layer_types": ("sliding_attention", "sliding_attention", "full_attention"),
    "sliding_window": 8,
    "query_pre_attn_scalar": 24,
    "tie_word_embeddings": False,
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "head_dim": 16,
}
# 4-token blocks; the least pool for three groups at max_model_len 128 with 16-token chunks
# is 1 + 32 + 2 * 11 = 55 blocks: a few long requests already preempt each other.
HYBRID_ENGINE = {
    "kv_block_size": 4,
    "max_model_len": 128,
    "num_kv_blocks": 64,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 8,
}
PREFIX = "paged attention keeps the KV cache in blocks of tokens, and a window slides over "
PROMPTS = [PREFIX + tail for tail in ("them.", "the past", "a long story", "1, 2, 3,")]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# (path, body, deterministic): bodies without "model" and "stream".
MIX: list[tuple[str, dict[str, Any], bool]] = [
    ("/completions", {"prompt": PROMPTS[0], "temperature": 0.0, "max_tokens": 12}, True),
    (
        "/completions",
        {"prompt": PROMPTS[1], "temperature": 0.9, "top_p": 0.8, "seed": 7, "max_tokens": 10},
        True,
    ),
    ("/completions", {"prompt": PROMPTS[2], "temperature": 1.0, "n": 3, "max_tokens": 8}, False),
    (
        "/completions",
        {"prompt": PROMPTS[3], "temperature": 0.0, "logprobs": 2, "stop": ["e"], "max_tokens": 16},
        True,
    ),
    (
        "/chat/completions",
        {
            "messages": [{"role": "user", "content": PROMPTS[0]}],
            "temperature": 0.7,
            "top_k": 5,
            "seed": 3,
            "max_tokens": 12,
            "logprobs": True,
            "top_logprobs": 2,
        },
        True,
    ),
    (
        "/chat/completions",
        {
            "messages": [{"role": "user", "content": PROMPTS[2]}],
            "temperature": 0.0,
            "max_tokens": 20,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA},
            },
        },
        True,
    ),
    (
        "/chat/completions",
        {"messages": [{"role": "user", "content": PROMPTS[1]}], "n": 2, "max_tokens": 14},
        False,
    ),
]


@pytest.fixture(scope="module")
def hybrid_server(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    checkpoint = make_checkpoint("tiny", with_tokenizer=True, **GEMMA3)
    log_path = tmp_path_factory.mktemp("hybrid-server") / "server.log"
    server = start_server(checkpoint, log_path, **HYBRID_ENGINE)
    try:
        yield server
    finally:
        server.stop()


async def send(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], stream: bool
) -> dict[int, str]:
    """One request; the text of each choice (streamed deltas joined)."""
    payload = {"model": MODEL_NAME, **body, "stream": stream}
    chat = path == "/chat/completions"
    if not stream:
        response = await client.post(path, json=payload)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        return {c["index"]: c["message"]["content"] if chat else c["text"] for c in choices}
    texts: dict[int, str] = {}
    async with client.stream("POST", path, json=payload) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                piece = (choice.get("delta") or {}).get("content") if chat else choice["text"]
                texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    return texts


async def hang_up(client: httpx.AsyncClient) -> None:
    """A long stream closed after its first chunks."""
    body = {"prompt": PROMPTS[2], "max_tokens": 100, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/completions", json={"model": MODEL_NAME, **body}) as r:
        assert r.status_code == 200
        chunks = 0
        async for _ in r.aiter_lines():
            chunks += 1
            if chunks >= 4:
                break


def test_concurrent_mixed_streams_and_a_hang_up_leave_the_hybrid_server_clean(
    hybrid_server: ServerProcess,
) -> None:
    base = hybrid_server.api_url

    async def together() -> list[Any]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            jobs = [
                send(client, path, body, stream)
                for stream in (False, True)
                for path, body, _ in MIX
            ]
            return await asyncio.gather(hang_up(client), *jobs)

    async def alone() -> list[dict[int, str]]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            return [await send(client, path, body, False) for path, body, _ in MIX]

    _, *mixed = asyncio.run(asyncio.wait_for(together(), timeout=120))
    single = asyncio.run(asyncio.wait_for(alone(), timeout=120))
    for index, (path, body, deterministic) in enumerate(MIX):
        plain, streamed = mixed[index], mixed[len(MIX) + index]
        assert len(plain) == len(streamed) == body.get("n", 1), (path, body)
        if deterministic:
            assert plain == streamed == single[index], (path, body)
        if "response_format" in body:
            assert single[index][0].startswith("{")  # cut by max_tokens: JSON's start
    metrics: dict[str, float] = {}
    for _ in range(100):  # the hung-up stream's abort reaches the engine asynchronously
        metrics = hybrid_server.metrics()
        if metrics["pagedinfer_num_requests_running"] == 0:
            break
        time.sleep(0.1)
    assert metrics["pagedinfer_num_requests_running"] == 0
    assert metrics["pagedinfer_num_requests_waiting"] == 0
    assert metrics["pagedinfer_kv_cache_usage_ratio"] == 0
    assert metrics['pagedinfer_requests_finished_total{finish_reason="abort"}'] >= 1
    assert metrics["pagedinfer_num_preemptions_total"] > 0
    assert httpx.get(hybrid_server.base_url + "/health", timeout=10).status_code == 200
