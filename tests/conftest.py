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


# Qwen3's way of turning thinking off, in short: the template closes the think block.
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


@pytest.fixture(scope="session")
def thinking_checkpoint(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny checkpoint (with a tokenizer) whose vocabulary ends with Qwen3's ``<think>``
    and ``</think>`` as single tokens (added, not special: they stay in decoded text), and
    :data:`THINKING_TEMPLATE` as its chat template."""
    import json
    import shutil

    from pagedinfer.adapters.models.random_checkpoint import build_tokenizer

    source = make_checkpoint("tiny", with_tokenizer=True)
    target = tmp_path_factory.mktemp("ckpt-thinking")
    shutil.copytree(source, target, dirs_exist_ok=True)
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    tokenizer = build_tokenizer(vocab_size - 2)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(str(target))
    assert tokenizer.convert_tokens_to_ids("</think>") == vocab_size - 1
    return target
