"""The checkpoint's ``generation_config.json`` as default sampling parameters, as vLLM reads it.

``generation_config="auto"`` (vLLM's default): the fields vLLM takes from the model's
``generation_config.json`` (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, and ``max_new_tokens`` as ``max_tokens``) are the defaults of every
request that does not set them: ``Engine``/``LLM`` calls without sampling parameters, and the
fields an HTTP request leaves out (``pagedinfer serve``). ``"vllm"`` ignores the file
(``SamplingParams``' own defaults); a directory reads the file in that directory.
``override_generation_config`` (a dict; ``--override-generation-config`` JSON) is applied
over them. One reading serves ``LLM``, ``Engine`` and the server.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.errors import (
    ConfigurationError,
    InvalidSamplingParamsError,
    UnsupportedModelError,
)

__all__ = [
    "GENERATION_FIELDS",
    "check_generation_config",
    "generation_defaults",
    "parse_override_generation_config",
]

# Fields of generation_config.json that become default sampling parameters (vLLM's list);
# max_new_tokens becomes max_tokens.
GENERATION_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")

_EXPECTED = (
    "expected 'auto' (the model's generation_config.json, vLLM's default), 'vllm' "
    "(SamplingParams' defaults) or a directory that holds a generation_config.json"
)


def check_generation_config(source: object, overrides: object) -> None:
    """Raise :class:`ConfigurationError` unless ``source`` is ``"auto"``, ``"vllm"`` or a
    directory, and ``overrides`` a dict or ``None``."""
    if not isinstance(source, (str, os.PathLike)) or (
        source not in ("auto", "vllm") and not os.path.isdir(source)
    ):
        raise ConfigurationError(f"generation_config={source!r} is invalid: {_EXPECTED}.")
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigurationError(
            f"override_generation_config={overrides!r} is invalid: expected a dict of "
            "sampling fields, such as {'temperature': 0.6}."
        )


def parse_override_generation_config(text: str) -> dict[str, object]:
    """``--override-generation-config``: a JSON object, kept as the dict."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(
            f"expected a JSON object such as '{{\"temperature\": 0.6}}', got {text!r} ({error})"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object such as '{{\"temperature\": 0.6}}', got {text!r}")
    return value


def generation_defaults(
    model_path: str | os.PathLike[str],
    source: str | os.PathLike[str],
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The default sampling fields (``SamplingParams``' names) ``source`` gives for the
    checkpoint at ``model_path``; checked: an invalid value raises
    :class:`ConfigurationError` naming the file."""
    check_generation_config(source, overrides)
    if source == "vllm":
        config: dict[str, Any] = {}
        where = "override_generation_config"
    else:
        directory = Path(model_path if source == "auto" else source)
        config = _read_generation_config(directory / "generation_config.json")
        where = str(directory / "generation_config.json")
    if overrides:
        config.update(overrides)
        where += " (with override_generation_config)"
    fields = {name: config[name] for name in GENERATION_FIELDS if config.get(name) is not None}
    if config.get("max_new_tokens") is not None:
        fields["max_tokens"] = config["max_new_tokens"]
    try:
        SamplingParams(**fields)
    except (InvalidSamplingParamsError, TypeError) as error:
        raise ConfigurationError(f"{where} gives an invalid default: {error}") from error
    return fields


def _read_generation_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UnsupportedModelError(
            f"{str(path)!r} cannot be read as JSON ({error}): copy it again from the original "
            "checkpoint, or pass generation_config='vllm' (--generation-config vllm) to ignore it."
        ) from error
    if not isinstance(config, dict):
        raise UnsupportedModelError(
            f"{str(path)!r} holds {type(config).__name__}, not a JSON object: copy it again "
            "from the original checkpoint, or pass generation_config='vllm' to ignore it."
        )
    return config
