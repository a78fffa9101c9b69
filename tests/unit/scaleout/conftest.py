"""Fixtures of the Ray Data tests: a tiny checkpoint with a tokenizer and a chat template.

Registers the ``ray`` marker: ``pytest -m ray`` runs the tests that start a local Ray cluster.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Small and quick on 2 cores; shared by the in-process reference and the replicas.
ENGINE_KWARGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "num_kv_blocks": 64,
    "max_model_len": 256,
}

# A minimal template: roles in angle brackets, the assistant's turn opened at the end, and
# one template variable (as Qwen3's enable_thinking) to show chat_template_kwargs arrive.
CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: starts a local Ray cluster (2 CPUs)")


@pytest.fixture(scope="session")
def chat_checkpoint(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny checkpoint with a tokenizer whose config carries ``CHAT_TEMPLATE``."""
    from transformers import AutoTokenizer

    source = make_checkpoint("tiny", with_tokenizer=True)
    target = tmp_path_factory.mktemp("ckpt-chat") / "model"
    shutil.copytree(source, target)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(target))
    return target
