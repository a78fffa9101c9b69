"""Unreadable or corrupt tokenizer files: errors that name the file (issue 11.5, tokenizer part).

They gave bare library errors naming no file (a JSONDecodeError, or transformers' advice to
install sentencepiece for a symlink loop).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedinfer import Engine
from pagedinfer.errors import UnsupportedModelError

OPTIONS = {"device": "cpu", "kv_block_size": 16, "max_model_len": 64, "num_kv_blocks": 8}


@pytest.fixture
def checkpoint(make_checkpoint: Callable[..., Path], tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint("tiny", with_tokenizer=True), copy)
    return copy


def _truncate(path: Path) -> None:
    path.write_text(path.read_text()[:40])


def _empty(path: Path) -> None:
    path.write_text("")


def _loop(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.name)


def _dangling(path: Path) -> None:
    path.unlink()
    path.symlink_to("missing.json")


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (_truncate, "is not valid JSON"),
        (_empty, "is not valid JSON"),
        (_loop, "cannot be read"),
        (_dangling, "cannot be read"),
        (_directory, "cannot be read"),
    ],
)
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_damaged_tokenizer_file_is_named(
    checkpoint: Path, name: str, damage: Callable[[Path], None], expected: str
) -> None:
    damage(checkpoint / name)
    with pytest.raises(UnsupportedModelError) as error:
        Engine(checkpoint, **OPTIONS)
    message = str(error.value)
    assert repr(str(checkpoint / name)) in message and expected in message


def test_our_config_check_runs_before_the_tokenizer_reads_config_json(checkpoint: Path) -> None:
    """transformers' tokenizer loading reads config.json too; our own error comes first."""
    _truncate(checkpoint / "config.json")
    with pytest.raises(UnsupportedModelError, match=r"config\.json"):
        Engine(checkpoint, **OPTIONS)


def test_a_checkpoint_without_tokenizer_files_serves_token_ids(checkpoint: Path) -> None:
    for name in os.listdir(checkpoint):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            (checkpoint / name).unlink()
    with Engine(checkpoint, **OPTIONS) as engine:
        assert engine.tokenizer is None
