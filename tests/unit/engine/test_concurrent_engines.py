"""No process-wide torch state: engines built at the same time in threads stay independent.

Building an engine once called ``torch.set_default_dtype`` (process-wide) around model
construction: another thread saw bfloat16 meanwhile, and two engines built at once could get
each other's parameter dtype. Models are now built with explicit dtypes and devices.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_reference import hf_greedy
from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.model_runner import ModelRunner

PROMPTS = [[5, 17, 300, 42, 9], [1, 2, 3], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SETTINGS: dict[str, Any] = {"device": "cpu", "max_model_len": 128, "num_kv_blocks": 16}


def _runner(engine: Engine) -> ModelRunner:
    runner = engine._executor
    assert isinstance(runner, ModelRunner)
    return runner


def _tokens(engine: Engine) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_engines_built_in_threads_keep_their_dtypes(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Any call to the process-wide setters, from any thread, is a failure.
    calls: list[str] = []
    monkeypatch.setattr(torch, "set_default_dtype", lambda dtype: calls.append(f"dtype {dtype}"))
    monkeypatch.setattr(torch, "set_default_device", lambda dev: calls.append(f"device {dev}"))
    with Engine(tiny_checkpoint, dtype="bfloat16", **SETTINGS) as alone:
        expected_bf16 = _tokens(alone)

    start = threading.Barrier(3)
    stop = threading.Event()
    seen_defaults: set[torch.dtype] = set()
    results: dict[str, list[list[int]]] = {}
    param_dtypes: dict[str, set[torch.dtype]] = {}
    errors: list[BaseException] = []

    def watch() -> None:
        start.wait()
        while not stop.is_set():
            seen_defaults.add(torch.get_default_dtype())

    def build_and_generate(dtype: str) -> None:
        try:
            start.wait()
            with Engine(tiny_checkpoint, dtype=dtype, **SETTINGS) as engine:
                model = _runner(engine).model
                param_dtypes[dtype] = {param.dtype for param in model.parameters()}
                results[dtype] = _tokens(engine)
        except BaseException as error:  # surfaced below, in the test's thread
            errors.append(error)

    threads = [
        threading.Thread(target=build_and_generate, args=(dtype,))
        for dtype in ("float32", "bfloat16")
    ]
    watcher = threading.Thread(target=watch)
    for thread in [*threads, watcher]:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    stop.set()
    watcher.join(timeout=30)
    assert not errors, errors
    assert calls == []
    assert seen_defaults == {torch.float32}
    assert param_dtypes == {"float32": {torch.float32}, "bfloat16": {torch.bfloat16}}
    assert results["float32"] == [hf_greedy(tiny_checkpoint, p, 8) for p in PROMPTS]
    assert results["bfloat16"] == expected_bf16


def test_model_construction_reads_no_default_dtype(tiny_checkpoint: Path) -> None:
    """Even a caller that changed the default dtype gets the dtype it asked for."""
    expected = [hf_greedy(tiny_checkpoint, p, 8) for p in PROMPTS]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with Engine(tiny_checkpoint, dtype="float32", **SETTINGS) as engine:
            model = _runner(engine).model
            assert {param.dtype for param in model.parameters()} == {torch.float32}
            assert _runner(engine).kv_cache.dtype is torch.float32
            assert _tokens(engine) == expected
    finally:
        torch.set_default_dtype(previous)
