"""Soak: a few hundred concurrent clients against a real ``pagedinfer serve`` (issue 21,
item 10).

300 clients at once, each one request drawn from a seeded mix: completions and chat,
streamed and not, greedy, top-k, top-p, min-p, penalties, ``logit_bias``, ``n`` > 1, stop
strings, logprobs, seeds; some clients hang up early (mid-stream, or before the answer), a
few send malformed requests. The KV cache is small enough that requests queue and get
preempted. Every answer is checked for its shape, identical greedy or seeded requests for
identical text (whatever else shared their batches), and afterwards the server must be idle
and clean: ``/health`` 200, nothing running or waiting, every KV block free, its memory
within a bound.

The greedy + top-k pair that crashed a step (issue 21, item 1) is part of the mix.

The soak runs twice: on a plain server, and on one with n-gram speculative decoding (issue
26), where every request of the same mix is speculated; its greedy and seeded texts must equal
the plain server's.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from tests.unit.serving.conftest import MODEL_NAME, ServerProcess, start_server

NUM_CLIENTS = 300
SEED = 21
# Queueing and preemption: 64 running at most, 96 blocks of 16 tokens for 300 clients.
SOAK_ENGINE = {"num_kv_blocks": 96, "max_num_seqs": 64, "max_model_len": 512}
PROMPTS = [
    "Once upon a time",
    "The quick brown fox",
    "paged attention keeps the KV cache in blocks",
    "Hello, world! How are you today?",
    "1, 2, 3, 4,",
]
SAMPLING: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 0.8, "top_k": 20},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.7, "min_p": 0.1},
    {"temperature": 1.0, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    {"temperature": 0.9, "repetition_penalty": 1.3, "top_k": 50, "top_p": 0.95},
    {"temperature": 1.0, "logit_bias": {"5": 5.0, "6": -100}},
    {"temperature": 1.0, "n": 3, "seed": 5},
    {"temperature": 0.0, "n": 2},
    {"temperature": 1.0, "stop": ["e", "the"], "include_stop_str_in_output": True},
    {"temperature": 0.0, "stop": [" ", "a"]},
    {"temperature": 1.0, "seed": 1234},
    {"temperature": 0.6, "top_k": 5, "min_tokens": 2},
]
MALFORMED: list[tuple[str, bytes, int]] = [
    ("/completions", b'{"prompt": "x", ', 400),
    ("/completions", b'{"prompt": "x", "max_tokens": "10"}', 400),
    ("/completions", b'{"prompt": [true, false]}', 400),
    ("/completions", b'{"prompt": "x", "n": 1000000000}', 400),
    ("/completions", b'{"prompt": "x", "logit_bias": {"1": 1000}}', 400),
    ("/completions", b'{"prompt": "x", "temperature": 1e39}', 400),
    ("/completions", b'{"prompt": "x", "model": "another-model"}', 404),
    ("/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("/chat/completions", b'{"messages": []}', 400),
    ("/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400),
]


# The servers: plain, and speculating with the n-gram proposer (vLLM's JSON flag).
SERVERS: dict[str, dict[str, Any]] = {
    "plain": {},
    "ngram": {
        "speculative_config": json.dumps(
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
        )
    },
}
# Each server's greedy and seeded texts by request (the speculative run compares).
DETERMINISTIC: dict[str, dict[str, set[tuple[str, ...]]]] = {}


@pytest.fixture(scope="module", params=list(SERVERS))
def soak_server(
    request: pytest.FixtureRequest,
    chat_checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, ServerProcess]]:
    """(which server, the server)."""
    server = start_server(
        chat_checkpoint,
        tmp_path_factory.mktemp("soak") / "server.log",
        **SOAK_ENGINE,
        **SERVERS[request.param],
    )
    try:
        yield request.param, server
    finally:
        server.stop()


def plan(rng: random.Random) -> dict[str, Any]:
    """One client's request: what it sends and how it behaves."""
    if rng.random() < 0.06:
        path, body, status = rng.choice(MALFORMED)
        return {"kind": "malformed", "path": path, "raw": body, "status": status}
    sampling = dict(rng.choice(SAMPLING))
    chat = rng.random() < 0.3
    prompt = rng.choice(PROMPTS)
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": rng.randint(4, 16),
        "stream": rng.random() < 0.5,
        **sampling,
    }
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.3:
            body |= {"logprobs": True, "top_logprobs": rng.randint(0, 3)}
    else:
        body["prompt"] = prompt if rng.random() < 0.8 else [prompt, rng.choice(PROMPTS)]
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 3)
    if body["stream"] and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    hang_up = rng.random() < 0.15
    return {
        "kind": "chat" if chat else "completion",
        "path": "/chat/completions" if chat else "/completions",
        "body": body,
        "hang_up": hang_up,
        "hang_up_after": rng.uniform(0.05, 1.0),
    }


def expected_choices(request: dict[str, Any]) -> int:
    body = request["body"]
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    return prompts * body.get("n", 1)


def check_choice(choice: dict[str, Any], request: dict[str, Any]) -> None:
    assert choice["finish_reason"] in ("stop", "length"), choice
    if choice["finish_reason"] == "length" and request["body"].get("ignore_eos"):
        assert "stop" not in request["body"] or choice["stop_reason"] is None


async def run_client(client: httpx.AsyncClient, request: dict[str, Any]) -> tuple[str, Any]:
    """Send one request; return (outcome, texts by choice index) for later checks."""
    url = request["path"]
    if request["kind"] == "malformed":
        response = await client.post(
            url, content=request["raw"], headers={"Content-Type": "application/json"}
        )
        assert response.status_code == request["status"], (request, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        return "malformed", None
    body = request["body"]
    if not body["stream"]:
        call = client.post(url, json=body)
        if request["hang_up"]:
            try:
                await asyncio.wait_for(call, request["hang_up_after"])
            except asyncio.TimeoutError:
                return "hung up", None
            return "finished first", None
        response = await call
        assert response.status_code == 200, (body, response.text)
        reply = response.json()
        choices = sorted(reply["choices"], key=lambda choice: choice["index"])
        assert [c["index"] for c in choices] == list(range(expected_choices(request)))
        for choice in choices:
            check_choice(choice, request)
        texts = [c["message"]["content"] if "message" in c else c["text"] for c in choices]
        assert reply["usage"]["completion_tokens"] > 0
        return "ok", texts
    texts: dict[int, str] = defaultdict(str)
    finished: dict[int, dict[str, Any]] = {}
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200, (body, await response.aread())
        events = 0
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            if request["hang_up"] and events >= 2:
                return "hung up", None  # leaving the block closes the connection
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                delta = choice.get("delta", {}).get("content", choice.get("text", ""))
                texts[choice["index"]] += delta or ""
                if choice["finish_reason"] is not None:
                    finished[choice["index"]] = choice
        assert done
    assert sorted(finished) == list(range(expected_choices(request))), finished
    for choice in finished.values():
        check_choice(choice, request)
    return "ok", [texts[index] for index in sorted(texts)]


def deterministic_key(request: dict[str, Any]) -> str | None:
    """Requests whose text depends only on themselves: greedy, or seeded."""
    body = request.get("body")
    if body is None or (body.get("temperature", 1.0) > 0 and body.get("seed") is None):
        return None
    return json.dumps({k: v for k, v in body.items() if k != "stream"}, sort_keys=True)


def test_hundreds_of_concurrent_clients_leave_the_server_clean(
    soak_server: tuple[str, ServerProcess],
) -> None:
    kind, server = soak_server
    rng = random.Random(SEED)
    requests = [plan(rng) for _ in range(NUM_CLIENTS)]
    process = psutil.Process(server.process.pid)
    # Warm up (first requests allocate the allocator's pools), then take the baseline.
    warm = {"prompt": "warm up", "max_tokens": 8, "n": 3}
    for _ in range(3):
        assert httpx.post(server.api_url + "/completions", json=warm, timeout=60)
    rss_before = process.memory_info().rss

    async def main() -> list[tuple[str, Any]]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.api_url, limits=limits, timeout=120) as client:
            return list(await asyncio.gather(*(run_client(client, r) for r in requests)))

    started = time.monotonic()
    results = asyncio.run(asyncio.wait_for(main(), 240))
    seconds = time.monotonic() - started
    outcomes = [outcome for outcome, _ in results]
    assert outcomes.count("ok") > NUM_CLIENTS // 2, outcomes
    assert outcomes.count("hung up") > 10 and outcomes.count("malformed") > 5, outcomes
    # Identical greedy or seeded requests gave identical texts, whatever they were batched
    # with (streamed or not).
    by_key: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    for request, (outcome, texts) in zip(requests, results, strict=True):
        key = deterministic_key(request)
        if key is not None and outcome == "ok":
            by_key[key].add(tuple(texts))
    assert sum(1 for texts in by_key.values() if texts) >= 5
    for key, texts in by_key.items():
        assert len(texts) == 1, (key, texts)
    DETERMINISTIC[kind] = by_key
    if kind != "plain" and "plain" in DETERMINISTIC:  # speculation changes no such text
        plain = DETERMINISTIC["plain"]
        shared = [key for key in by_key if by_key[key] and plain.get(key)]
        assert len(shared) >= 5
        for key in shared:
            assert by_key[key] == plain[key], (key, by_key[key], plain[key])

    # Idle and clean: aborted requests are freed at once; give the last steps a moment.
    deadline = time.monotonic() + 30
    while True:
        metrics = server.metrics()
        idle = (
            metrics["pagedinfer_num_requests_running"] == 0
            and metrics["pagedinfer_num_requests_waiting"] == 0
            and metrics["pagedinfer_kv_cache_usage_ratio"] == 0
        )
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, {k: v for k, v in metrics.items() if "num_requests" in k or "kv" in k}
    assert metrics['pagedinfer_requests_finished_total{finish_reason="abort"}'] > 0
    if kind == "ngram":
        assert metrics["pagedinfer_spec_decode_num_accepted_tokens_total"] > 0
    assert httpx.get(server.base_url + "/health").status_code == 200
    growth = process.memory_info().rss - rss_before
    assert growth < 200 * 1024 * 1024, f"RSS grew by {growth / 2**20:.0f} MiB"
    print(
        f"soak: {NUM_CLIENTS} clients in {seconds:.1f} s, RSS {growth / 2**20:+.0f} MiB, "
        f"{ {o: outcomes.count(o) for o in set(outcomes)} }, "
        f"preemptions {metrics['pagedinfer_num_preemptions_total']:.0f}, "
        f"deterministic groups {sum(1 for texts in by_key.values() if texts)}, "
        f"tokens {metrics['pagedinfer_generation_tokens_total']:.0f}"
    )
