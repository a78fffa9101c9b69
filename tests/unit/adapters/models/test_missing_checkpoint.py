"""A model path that is not a directory: a hub-style id is told to download first (#12)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.errors import CheckpointNotFoundError


@pytest.mark.parametrize("model", ["Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B-Instruct"])
def test_a_hub_id_says_to_download_it_and_pass_the_directory(model: str) -> None:
    with pytest.raises(CheckpointNotFoundError) as error:
        ModelConfig.from_pretrained(model)
    message = str(error.value)
    assert "Hugging Face Hub id" in message
    assert f"`hf download {model} --local-dir ./{model.split('/')[1]}" in message
    assert "pass that directory" in message
    assert "huggingface-cli" not in message  # recent huggingface_hub releases do not ship it


@pytest.mark.parametrize("relative", ["missing", "./a/b", "a/b/c", "../x"])
def test_other_missing_paths_name_the_path(
    relative: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointNotFoundError) as error:
        ModelConfig.from_pretrained(relative)
    message = str(error.value)
    assert repr(relative) in message and "does not exist" in message
    assert "Hub id" not in message


def test_a_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(CheckpointNotFoundError, match="not a directory"):
        ModelConfig.from_pretrained(file)
