"""Shared test fixtures.

``make_checkpoint(name="tiny", *, with_tokenizer=False, seed=0, **overrides) -> Path`` builds a
random-weight checkpoint directory (config.json + safetensors, optionally a small BPE
tokenizer) with :func:`pagedinfer.adapters.models.random_checkpoint.build_random_checkpoint`.
``name`` is a preset of ``random_checkpoint.PRESETS`` (Qwen3 shapes) and ``overrides`` replace
fields of its ``RandomModelSpec`` (``architecture="LlamaForCausalLM"``,
``num_key_value_heads=4``, ``rope_scaling={"rope_type": "linear", "factor": 2.0}``, ...). Each
distinct set of arguments is built once per test session and shared; treat the directory as
read-only (copy it if a test needs to damage it).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU-only machines. Must be set before
    # triton is first imported, which happens no earlier than test collection.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def python_sigint_handler() -> Iterator[None]:
    """Every test starts under Python's own SIGINT handler, whatever the parent set: a job
    started in the background (``make test &``, ``nohup``) inherits SIGINT ignored, under
    which Ctrl-C handling is rightly inactive and the tests of it would fail. Restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory of cached tiny random checkpoints (see the module docstring)."""
    from pagedinfer.adapters.models.random_checkpoint import build_random_checkpoint

    built: dict[tuple[Any, ...], Path] = {}

    def make(
        name: str = "tiny", *, with_tokenizer: bool = False, seed: int = 0, **overrides: Any
    ) -> Path:
        # repr: override values may be dicts (rope_scaling), which do not hash.
        key = (name, with_tokenizer, seed, repr(sorted(overrides.items())))
        if key not in built:
            target = tmp_path_factory.mktemp(f"ckpt-{name}")
            built[key] = build_random_checkpoint(
                target, name, seed=seed, with_tokenizer=with_tokenizer, **overrides
            )
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    """The default tiny checkpoint (GQA 4/2 heads, head_dim 32, 2 layers, tied embeddings)."""
    return make_checkpoint("tiny")
