"""vLLM's pooling arguments of ``LLM(...)`` as the engine's ``runner`` and ``pooler_config``.

* ``runner="pooling"`` (vLLM >= 0.10) and the older ``task="embed" | "classify" | "score" |
  "reward"`` / ``convert="embed" | "classify"`` select a pooling model;
* ``pooler_config`` / ``override_pooler_config``: :class:`PoolerConfig` or its dict;
* ``hf_overrides``: only what turns a causal LM into a classifier from tokens, as vLLM's
  Qwen3-Reranker recipe passes it: ``{"architectures": ["Qwen3ForSequenceClassification"],
  "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedinfer.engine.pooling_setup import PoolerConfig
from pagedinfer.errors import ConfigurationError

__all__ = ["vllm_pooling_kwargs"]

_POOLING_TASKS = frozenset({"embed", "embedding", "classify", "score", "reward", "encode"})
_HF_OVERRIDES = frozenset({"architectures", "classifier_from_token", "is_original_qwen3_reranker"})


def vllm_pooling_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take vLLM's pooling arguments out of ``kwargs``; return the engine's."""
    engine: dict[str, Any] = {}
    pooling = False
    for name in ("task", "convert"):
        value = kwargs.pop(name, None)
        if value in _POOLING_TASKS:
            pooling = True
        elif value not in (None, "auto", "generate", "none"):
            raise ConfigurationError(
                f"LLM({name}={value!r}) is not supported: expected 'auto', 'generate' or a "
                f"pooling task ({', '.join(sorted(_POOLING_TASKS))})."
            )
    overrides = kwargs.pop("hf_overrides", None) or {}
    if not isinstance(overrides, Mapping) or set(overrides) - _HF_OVERRIDES:
        raise ConfigurationError(
            f"LLM(hf_overrides={overrides!r}) is not supported: config.json is used as it is, "
            "except the classifier-from-token keys of vLLM's Qwen3-Reranker recipe "
            f"({', '.join(sorted(_HF_OVERRIDES))}; docs/pooling.md)."
        )
    config = kwargs.pop("pooler_config", None)
    override = kwargs.pop("override_pooler_config", None)
    if config is not None and override is not None:
        raise ConfigurationError("pass pooler_config or override_pooler_config, not both.")
    pooler = PoolerConfig.from_value(config if config is not None else override)
    if "classifier_from_token" in overrides:
        pooling = True
        pooler = PoolerConfig.from_value(
            {
                **_fields(pooler),
                "classifier_from_token": tuple(overrides["classifier_from_token"]),
                "is_original_qwen3_reranker": bool(
                    overrides.get("is_original_qwen3_reranker", False)
                ),
            }
        )
    if pooler != PoolerConfig():
        engine["pooler_config"] = pooler
    if pooling:
        runner = kwargs.pop("runner", "pooling")
        if runner not in ("auto", "pooling"):
            raise ConfigurationError(
                f"LLM(runner={runner!r}) contradicts the pooling task or hf_overrides given: "
                "pass runner='pooling' (or leave it out)."
            )
        engine["runner"] = "pooling"
    return engine


def _fields(config: PoolerConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}
