"""ModelConfig.from_pretrained: both config.json layouts, EOS ids, and every refusal."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.errors import CheckpointNotFoundError, UnsupportedModelError

# A Qwen3-0.6B style config.json as transformers 4.5x writes it.
LEGACY_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def write_checkpoint(
    directory: Path,
    config: dict[str, Any] | None,
    generation: dict[str, Any] | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


def legacy(*, drop: tuple[str, ...] = (), **changes: Any) -> dict[str, Any]:
    """The legacy config with keys ``drop`` removed and ``changes`` applied."""
    config = {key: value for key, value in LEGACY_CONFIG.items() if key not in drop}
    config.update(changes)
    return config


def test_transformers5_layout(make_checkpoint: Callable[..., Path]) -> None:
    path = make_checkpoint("tiny", rope_theta=123456.0)
    raw = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in raw and "rope_theta" not in raw  # really the new layout
    config = ModelConfig.from_pretrained(path)
    assert config.architecture == "Qwen3ForCausalLM"
    assert config.path == path
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (512, 64, 128)
    assert (config.num_hidden_layers, config.num_attention_heads) == (2, 4)
    assert (config.num_key_value_heads, config.head_dim) == (2, 32)
    assert config.rope_theta == 123456.0
    assert config.dtype is torch.float32
    assert config.tie_word_embeddings is True
    assert config.attention_bias is False
    assert config.max_position_embeddings == 4096
    assert config.rms_norm_eps == 1e-6
    assert config.eos_token_ids == ()


def test_legacy_layout(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "m", legacy(), {"eos_token_id": [151645, 151643]})
    config = ModelConfig.from_pretrained(str(path))
    assert config.rope_theta == 1_000_000.0
    assert config.dtype is torch.bfloat16
    assert config.head_dim == 1024 // 16  # no head_dim key: hidden / heads
    assert config.eos_token_ids == (151645, 151643)


@pytest.mark.parametrize(
    ("generation", "config_eos", "expected"),
    [
        (None, 7, (7,)),
        (None, [7, 8, 7], (7, 8)),
        ({"eos_token_id": 3}, 7, (3,)),
        ({"eos_token_id": None}, [7], (7,)),
        ({}, None, ()),
    ],
)
def test_eos_ids(
    tmp_path: Path, generation: dict[str, Any] | None, config_eos: Any, expected: tuple[int, ...]
) -> None:
    path = write_checkpoint(tmp_path / "m", legacy(eos_token_id=config_eos), generation)
    assert ModelConfig.from_pretrained(path).eos_token_ids == expected


@pytest.mark.parametrize(
    ("name", "dtype"), [("float16", torch.float16), ("float32", torch.float32)]
)
def test_dtype_names(tmp_path: Path, name: str, dtype: torch.dtype) -> None:
    path = write_checkpoint(tmp_path / "m", legacy(torch_dtype=name))
    assert ModelConfig.from_pretrained(path).dtype is dtype


def test_missing_directory_is_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(CheckpointNotFoundError, match="nowhere") as info:
        ModelConfig.from_pretrained(missing)
    assert isinstance(info.value, FileNotFoundError)


def test_a_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    file = tmp_path / "weights.bin"
    file.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"weights\.bin"):
        ModelConfig.from_pretrained(file)


def test_no_config_json(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "empty", None)
    with pytest.raises(UnsupportedModelError, match=r"config\.json") as info:
        ModelConfig.from_pretrained(path)
    assert isinstance(info.value, ValueError)
    assert "empty" in str(info.value)


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        (legacy(architectures=["LlamaForCausalLM"]), "LlamaForCausalLM"),
        (legacy(drop=("architectures",)), "architectures"),
        (legacy(rope_scaling={"type": "linear", "factor": 2.0}), "'linear'"),
        (legacy(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'yarn'"),
        (
            legacy(drop=("rope_theta",), rope_parameters={"rope_type": "llama3", "rope_theta": 1}),
            "'llama3'",
        ),
        (legacy(use_sliding_window=True, sliding_window=4096, max_window_layers=20), "sliding"),
        (legacy(layer_types=["sliding_attention"] + ["full_attention"] * 27), "sliding"),
        (legacy(torch_dtype="float8_e4m3fn"), "float8_e4m3fn"),
        (legacy(hidden_act="gelu"), "gelu"),
        (legacy(drop=("vocab_size",)), "vocab_size"),
        (legacy(num_attention_heads=0), "num_attention_heads"),
        (legacy(num_key_value_heads=3), "num_key_value_heads"),
    ],
)
def test_unsupported_models(tmp_path: Path, config: dict[str, Any], fragment: str) -> None:
    path = write_checkpoint(tmp_path / "model-dir", config)
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_pretrained(path)
    message = str(info.value)
    assert fragment in message
    assert "model-dir" in message  # names the checkpoint


def test_unsupported_architecture_names_what_is_expected(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "m", legacy(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        ModelConfig.from_pretrained(path)


def test_default_rope_type_is_accepted_in_both_layouts(tmp_path: Path) -> None:
    new = legacy(drop=("rope_theta",), rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert ModelConfig.from_pretrained(write_checkpoint(tmp_path / "a", new)).rope_theta == 5e5
    old = legacy(rope_scaling={"rope_type": "default"}, rope_theta=7e5)
    assert ModelConfig.from_pretrained(write_checkpoint(tmp_path / "b", old)).rope_theta == 7e5


def test_unreadable_json(tmp_path: Path) -> None:
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match=r"config\.json"):
        ModelConfig.from_pretrained(path)
