"""A step's launch never makes the host wait for the device (issue 37).

Async scheduling launches step N+1 while step N runs: one blocking copy or read in the launch
waits for step N's whole forward. The real engine runs async steps (sampling with seeds,
penalties, ``min_tokens``, logprobs, prompt logprobs and ``n > 1`` forks, preemption) and
speculative steps (n-gram and draft model) with :class:`tests.sync_spy.SyncSpy` watching
``ModelRunner.launch``; any call that would wait on CUDA fails the test with its code line.
The spy itself must catch the kind of call it guards against. A static check keeps
``non_blocking=False`` out of the adapters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.sync_spy import SyncSpy

from pagedinfer import Engine, SamplingParams

OPTIONS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 4,
    "num_kv_blocks": 24,
    "max_model_len": 64,
    "max_num_batched_tokens": 12,
    "max_num_seqs": 4,
}
ADAPTERS = Path(__file__).resolve().parents[3] / "src" / "pagedinfer" / "adapters"


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture
def spy() -> Iterator[SyncSpy]:
    spy = SyncSpy()
    with spy.installed():
        yield spy


def _watched(engine: Engine, spy: SyncSpy) -> None:
    runner = engine._executor
    assert runner is not None and hasattr(runner, "launch")
    runner.launch = spy.wrap(runner.launch)  # type: ignore[method-assign]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.8, seed=7, max_tokens=10, n=2, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, max_tokens=9, min_tokens=4, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=14, frequency_penalty=0.4, logit_bias={5: 2.0}),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, max_tokens=11),
    ]


def _prompts() -> list[list[int]]:
    return [
        [7, 8, 9, 10, 7, 8, 9, 10, 7, 8],
        [20, 21, 22] * 5,
        [3, 4],
        [40 + i for i in range(17)],
        [9] * 6,
    ]


def _run(engine: Engine) -> None:
    outputs = engine.generate(_prompts(), _params())
    assert all(completion.token_ids for output in outputs for completion in output.outputs)


def test_async_steps_launch_without_waiting(checkpoint: Path, spy: SyncSpy) -> None:
    with Engine(checkpoint, async_scheduling=True, **OPTIONS) as engine:
        _watched(engine, spy)
        _run(engine)
        assert engine._steps_done > 2
    assert spy.launches >= engine._steps_done and spy.calls == []


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_steps_launch_without_waiting(
    checkpoint: Path, spy: SyncSpy, method: str
) -> None:
    config: dict[str, object] = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        config |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:
        config["model"] = str(checkpoint)
    with Engine(checkpoint, speculative_config=config, **OPTIONS) as engine:
        _watched(engine, spy)
        _run(engine)
        assert engine.stats().spec_decode_num_draft_tokens > 0
        assert spy.launches > 2
    assert spy.calls == []


def test_the_spy_catches_what_would_wait(spy: SyncSpy) -> None:
    values = torch.arange(4)
    with spy.watching():
        values.tolist()
        values.to(torch.device("cpu"))
        torch.tensor([1, 2], device="cpu")
        values.to(torch.int32)  # a dtype change waits for nothing
        values.to("cpu", non_blocking=True)
    values[0].item()  # outside the watched block
    assert [call.split(" at ")[0] for call in spy.calls] == [
        "Tensor.tolist()",
        "a blocking Tensor.to(device)",
        "torch.tensor(..., device=)",
    ]
    assert all(__file__ in call for call in spy.calls)


def test_no_blocking_copy_is_written_in_the_adapters() -> None:
    offenders = [
        f"{path.relative_to(ADAPTERS)}:{number}"
        for path in sorted(ADAPTERS.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "non_blocking=False" in line
    ]
    assert offenders == []
