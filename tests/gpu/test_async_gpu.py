"""Async scheduling and speculative steps on a real GPU (issue 37): the same tokens as the
sync loop, and a launch that never waits for the device.

Async scheduling plans and launches step N+1 while step N runs; its overlap holds only if
:meth:`ModelRunner.launch` never blocks on the stream. Here every launch (after a warm-up that
compiles the kernels) runs under ``torch.cuda.set_sync_debug_mode("error")``: a blocking copy,
``.item()`` or ``.tolist()`` of a device tensor raises. The CPU guard of the same path is
``tests/unit/engine/test_launch_never_waits.py``. Run with ``make test-gpu``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer import Engine, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

OPTIONS: dict[str, Any] = {
    "device": "cuda",
    "dtype": "float32",
    "kv_block_size": 16,
    "max_model_len": 256,
    "num_kv_blocks": 40,  # small: long requests preempt
    "max_num_batched_tokens": 96,  # chunked prefill and mixed steps
    "max_num_seqs": 8,
}


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    system = [rng.randrange(512) for _ in range(24)]
    return [
        (system if index % 3 == 0 else []) + [rng.randrange(512) for _ in range(rng.randint(1, 60))]
        for index in range(10)
    ]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0.0 if index % 2 else 0.8,
            seed=200 + index,
            max_tokens=24 + 3 * index,
            ignore_eos=True,
            n=2 if index == 3 else 1,
            repetition_penalty=1.2 if index % 4 == 1 else 1.0,
            presence_penalty=0.3 if index % 5 == 2 else 0.0,
            min_tokens=5 if index == 6 else 0,
            logprobs=2 if index % 3 == 1 else None,
            prompt_logprobs=1 if index == 4 else None,
        )
        for index in range(10)
    ]


def _lengths(summary: list[list[tuple[int, ...]]]) -> list[list[int]]:
    return [[len(tokens) for tokens in output] for output in summary]


def _summary(engine: Engine) -> list[list[tuple[int, ...]]]:
    outputs = engine.generate(_prompts(), _params())
    return [[tuple(c.token_ids) for c in output.outputs] for output in outputs]


@contextmanager
def _launches_must_not_sync(engine: Engine) -> Iterator[list[int]]:
    """Every ``launch`` of ``engine``'s runner under sync debug mode "error" (restored
    after each launch and at the end); yields a list counting the launches."""
    runner = engine._executor
    assert runner is not None and hasattr(runner, "launch")
    original = runner.launch
    count: list[int] = []

    def strict_launch(plan: Any) -> Any:
        count.append(1)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.launch = strict_launch  # type: ignore[method-assign]
    try:
        yield count
    finally:
        runner.launch = original  # type: ignore[method-assign]
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny")


def test_async_equals_sync_on_cuda(checkpoint: Path) -> None:
    with Engine(checkpoint, async_scheduling=False, **OPTIONS) as engine:
        expected = _summary(engine)
    with Engine(checkpoint, async_scheduling=True, **OPTIONS) as engine:
        assert _summary(engine) == expected


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_async_launch_never_syncs(checkpoint: Path, graphs: bool) -> None:
    with Engine(checkpoint, async_scheduling=True, enforce_eager=not graphs, **OPTIONS) as engine:
        expected = _summary(engine)  # warm-up: kernels compiled, tables grown
        with _launches_must_not_sync(engine) as launches:
            # (Prefix-cache hits now change the prefill's arithmetic: compare lengths; the
            # tokens' parity with the sync loop is test_async_equals_sync_on_cuda's.)
            assert _lengths(_summary(engine)) == _lengths(expected)
        assert len(launches) > 10


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_launch_never_syncs(checkpoint: Path, method: str) -> None:
    config: dict[str, object] = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        config |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:
        config["model"] = str(checkpoint)
    with Engine(checkpoint, speculative_config=config, **OPTIONS) as engine:
        expected = _summary(engine)
        with _launches_must_not_sync(engine) as launches:
            # (Prefix-cache hits now change the prefill's arithmetic: compare lengths; the
            # tokens' parity with the sync loop is test_async_equals_sync_on_cuda's.)
            assert _lengths(_summary(engine)) == _lengths(expected)
        assert len(launches) > 5
        assert engine.stats().spec_decode_num_draft_tokens > 0


def test_uploads_and_readbacks_reuse_their_pinned_memory() -> None:
    from pagedinfer.adapters.host_transfers import HostUploads, Readbacks

    device = torch.device("cuda")
    uploads = HostUploads(device, arena_bytes=256)  # a few uploads per arena: they alternate
    readbacks = Readbacks(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        started = []
        for step in range(50):
            values = list(range(step, step + 20))
            started.append((values, readbacks.start(uploads.upload(values, torch.int64) * 2)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for values, readback in started:
        assert readback.read() == [2 * v for v in values]
