"""The model's default sampling fields for the fields a request leaves out (vLLM's
``--generation-config auto``): read once from the engine's configuration, by the code ``LLM``
and ``Engine`` use (:mod:`pagedinfer.engine.generation_config`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.generation_config import generation_defaults

__all__ = ["apply_generation_defaults", "request_defaults"]


def request_defaults(config: EngineConfig) -> dict[str, Any]:
    """The default sampling fields of ``config``'s ``generation_config`` (by
    ``SamplingParams``' names, which are the request fields' names)."""
    return generation_defaults(
        config.model_path, config.generation_config, config.override_generation_config
    )


def apply_generation_defaults(body: BaseModel, defaults: Mapping[str, Any]) -> None:
    """Give ``body`` each default whose field it leaves out (or sends as null);
    ``max_tokens`` only when neither it nor ``max_completion_tokens`` is sent."""
    fields = type(body).model_fields
    sent = body.model_fields_set
    for name, value in defaults.items():
        if name not in fields:
            continue  # a body without sampling fields (/tokenize)
        if name == "max_tokens":
            if "max_tokens" in sent or getattr(body, "max_completion_tokens", None) is not None:
                continue
        elif name in sent and getattr(body, name) is not None:
            continue
        setattr(body, name, value)
