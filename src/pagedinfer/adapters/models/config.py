"""What pagedinfer needs to know about a checkpoint, read from its ``config.json``.

Both ``config.json`` layouts in the wild are understood: transformers < 5 writes ``rope_theta``,
``rope_scaling`` and ``torch_dtype`` at the top level; transformers >= 5 writes
``rope_parameters: {rope_theta, rope_type}`` and ``dtype``. EOS ids come from
``generation_config.json`` when it names them (that is what ``generate`` stops on), else from
``config.json``; either may hold one id or a list.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from pagedinfer.adapters.models.registry import SUPPORTED_ARCHITECTURES
from pagedinfer.errors import CheckpointNotFoundError, UnsupportedModelError

__all__ = ["ModelConfig"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture hyper-parameters of one checkpoint directory."""

    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: torch.dtype  # the checkpoint's dtype ("auto" resolves to it)
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``path/config.json`` (and ``generation_config.json`` if present).

        Raises :class:`CheckpointNotFoundError` if ``path`` is not a directory and
        :class:`UnsupportedModelError` if it does not hold a model this library can run.
        """
        root = Path(path)
        if not root.is_dir():
            raise CheckpointNotFoundError(
                f"model path {str(root)!r} does not exist or is not a directory: expected a "
                "local Hugging Face checkpoint directory (config.json + *.safetensors)."
            )
        config_file = root / "config.json"
        if not config_file.is_file():
            raise UnsupportedModelError(
                f"checkpoint {str(root)!r} has no config.json: expected a Hugging Face "
                "checkpoint directory (config.json + *.safetensors)."
            )
        raw = _read_json(config_file)
        generation_file = root / "generation_config.json"
        generation = _read_json(generation_file) if generation_file.is_file() else None
        return cls.from_dict(raw, root, generation)

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        path: Path,
        generation: dict[str, Any] | None = None,
    ) -> ModelConfig:
        """Validate a parsed ``config.json`` (``path`` is only used in error messages)."""
        reader = _Reader(raw, path)
        architecture = reader.architecture()
        num_heads = reader.integer("num_attention_heads")
        hidden_size = reader.integer("hidden_size")
        num_layers = reader.integer("num_hidden_layers")
        head_dim = reader.optional_integer("head_dim")
        if head_dim is None:
            if hidden_size % num_heads:
                reader.fail(
                    f"hidden_size={hidden_size} is not divisible by num_attention_heads="
                    f"{num_heads} and config.json has no head_dim"
                )
            head_dim = hidden_size // num_heads
        num_kv_heads = reader.integer("num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads:
            reader.fail(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            reader.fail(f"hidden_act={hidden_act!r} is not supported: expected 'silu'")
        reader.reject_sliding_window(num_layers)
        eos = _token_ids(generation.get("eos_token_id") if generation else None)
        return cls(
            path=path,
            architecture=architecture,
            vocab_size=reader.integer("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=reader.integer("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=reader.number("rms_norm_eps", default=1e-6),
            rope_theta=reader.rope_theta(),
            max_position_embeddings=reader.integer("max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            dtype=reader.dtype(),
            eos_token_ids=eos or _token_ids(raw.get("eos_token_id")),
        )


class _Reader:
    """Typed access to ``config.json`` fields with errors that name the file and the field."""

    def __init__(self, raw: dict[str, Any], path: Path) -> None:
        self.raw = raw
        self.path = path

    def fail(self, problem: str) -> NoReturn:
        raise UnsupportedModelError(f"checkpoint {str(self.path)!r}: {problem}.")

    def architecture(self) -> str:
        architectures = self.raw.get("architectures")
        expected = ", ".join(SUPPORTED_ARCHITECTURES)
        if not isinstance(architectures, list) or not architectures:
            self.fail(f"config.json names no 'architectures'; expected one of: {expected}")
        for name in architectures:
            if name in SUPPORTED_ARCHITECTURES:
                return str(name)
        self.fail(f"architectures={architectures!r} is not supported; expected one of: {expected}")

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.raw.get(key, default)
        if value is None:
            self.fail(f"config.json has no {key!r}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            self.fail(f"{key}={value!r} is invalid: expected an integer >= 1")
        return value

    def optional_integer(self, key: str) -> int | None:
        return None if self.raw.get(key) is None else self.integer(key)

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            self.fail(f"{key}={value!r} is invalid: expected a positive number")
        return float(value)

    def rope_theta(self) -> float:
        # transformers >= 5: rope_parameters; older: top-level rope_theta + rope_scaling.
        params = self.raw.get("rope_parameters")
        if params is None:
            scaling = self.raw.get("rope_scaling")
            params = dict(scaling) if isinstance(scaling, dict) else {}
            params.setdefault("rope_theta", self.raw.get("rope_theta", 10000.0))
        if not isinstance(params, dict):
            self.fail(f"rope_parameters={params!r} is invalid: expected an object")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            self.fail(
                f"rope type {rope_type!r} is not supported: expected 'default' (plain RoPE, "
                "no scaling)"
            )
        theta = params.get("rope_theta", self.raw.get("rope_theta", 10000.0))
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
            self.fail(f"rope_theta={theta!r} is invalid: expected a positive number")
        return float(theta)

    def dtype(self) -> torch.dtype:
        name = self.raw.get("dtype", self.raw.get("torch_dtype")) or "float32"
        if isinstance(name, str):
            name = name.removeprefix("torch.")
        if name not in _DTYPES:
            self.fail(
                f"dtype {name!r} is not supported: expected one of float32, float16, bfloat16"
            )
        return _DTYPES[name]

    def reject_sliding_window(self, num_layers: int) -> None:
        layer_types = self.raw.get("layer_types")
        if isinstance(layer_types, list):
            sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
        elif self.raw.get("use_sliding_window") and self.raw.get("sliding_window") is not None:
            # transformers < 5: layers from max_window_layers on use the sliding window.
            first = self.raw.get("max_window_layers", 0)
            sliding = list(range(first, num_layers)) if isinstance(first, int) else [0]
        else:
            sliding = []
        if sliding:
            self.fail(
                f"layers {sliding} use sliding-window attention, which is not supported: "
                "expected full attention in every layer"
            )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UnsupportedModelError(f"cannot read {str(path)!r}: {error}") from error
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{str(path)!r} does not hold a JSON object")
    return data


def _token_ids(value: object) -> tuple[int, ...]:
    """An id, a list of ids or None -> a tuple without duplicates (order kept)."""
    values = value if isinstance(value, list) else [value]
    ids = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return tuple(dict.fromkeys(ids))
