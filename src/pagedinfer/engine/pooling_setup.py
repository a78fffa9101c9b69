"""How a pooling model (``runner="pooling"``) pools: :class:`PoolerConfig`, :class:`PoolingSetup`.

The pooling comes from the checkpoint as sentence-transformers lays it out: ``modules.json``
names a ``sentence_transformers.models.Pooling`` module whose ``config.json`` sets one of
``pooling_mode_lasttoken`` / ``pooling_mode_mean_tokens`` / ``pooling_mode_cls_token``, and a
``sentence_transformers.models.Normalize`` module normalizes. Without ``modules.json`` a
decoder embeds with its last token, normalized (vLLM's default for decoder embedders).
:class:`PoolerConfig` (vLLM's ``pooler_config``: the object or a dict) overrides any field.

Matryoshka: ``dimensions`` truncates an embedding where ``config.json`` allows it
(``is_matryoshka: true``, or ``matryoshka_dimensions``: the sizes allowed), as vLLM reads it.

Classification heads: a ``*ForSequenceClassification`` checkpoint's ``score`` head, or an LM's
rows of ``classifier_from_token`` (vLLM's ``hf_overrides`` for Qwen3-Reranker; see
``adapters/pooling/heads.py``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.errors import ConfigurationError, InvalidRequestError

if TYPE_CHECKING:
    from pagedinfer.engine.config import EngineConfig

__all__ = [
    "POOLER_HELP",
    "POOLING_PARAMS",
    "RUNNERS",
    "RUNNER_HELP",
    "PoolerConfig",
    "PoolingSetup",
    "parse_pooler_config",
    "pooling_engine_config",
    "pooling_setup",
    "refuse_generation",
]

RUNNERS: tuple[str, ...] = ("auto", "generate", "pooling")
RUNNER_HELP = (
    "pooling: embed, score, classify (docs/pooling.md); auto: generate, or pool a classifier"
)
POOLER_HELP = (
    "pooling as vLLM's JSON, e.g. '{\"pooling_type\": \"MEAN\"}'; default: the checkpoint's"
)
_TYPES = ("LAST", "MEAN", "CLS")
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_CLASSIFIER = "ForSequenceClassification"

POOLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
"""A pooling request's parameters: its prompt is computed, then it finishes (the one
placeholder token it records is never sampled)."""


def refuse_generation() -> None:
    """A pooling engine was asked to generate."""
    raise InvalidRequestError(
        "this engine runs a pooling model (runner='pooling'): it embeds, scores and "
        "classifies prompts (LLM.embed, LLM.score, LLM.classify; /v1/embeddings, /score, "
        "/rerank) and cannot generate; start it without runner='pooling' to generate."
    )


def pooling_engine_config(config: EngineConfig, setup: PoolingSetup | None) -> EngineConfig:
    """``config`` as a pooling model runs it: nothing is decoded, so no step runs ahead; the
    prefix cache is off unless the pooled row is always computed (last-token pooling)."""
    if setup is None:
        return config
    if config.speculative_config is not None:
        raise ConfigurationError(
            "speculative_config has no use with runner='pooling' (nothing is decoded): drop it."
        )
    return dataclasses.replace(
        config,
        async_scheduling=False,
        enable_prefix_caching=config.enable_prefix_caching and setup.prefix_caching,
    )


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """vLLM's ``PoolerConfig``: ``pooling_type`` ``"LAST"``, ``"MEAN"`` or ``"CLS"``;
    ``normalize`` (embeddings, L2); ``dimensions`` (Matryoshka: the default embedding size);
    ``activation`` (classification: sigmoid for one label, softmax for more).
    ``classifier_from_token`` and ``is_original_qwen3_reranker`` are vLLM's ``hf_overrides``
    of the same names (a causal LM scored by the logits of those tokens). ``None``: the
    checkpoint's (or the default)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    activation: bool | None = None
    classifier_from_token: tuple[str, ...] | None = None
    is_original_qwen3_reranker: bool = False

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type.upper() not in _TYPES:
            raise ConfigurationError(
                f"pooler_config pooling_type={self.pooling_type!r} is not supported: expected "
                f"one of {', '.join(_TYPES)}."
            )
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ConfigurationError(
                f"pooler_config dimensions={self.dimensions!r}: expected an integer >= 1."
            )

    @classmethod
    def from_value(cls, value: object) -> PoolerConfig:
        """A ``PoolerConfig``, or a dict of its fields (vLLM's names), checked."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            value = parse_pooler_config(value)
        if not isinstance(value, Mapping):
            raise ConfigurationError(
                f"pooler_config={value!r}: expected a PoolerConfig or a dict such as "
                '{"pooling_type": "MEAN", "normalize": true}.'
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigurationError(
                f"pooler_config has unknown field(s) {', '.join(map(repr, unknown))}: the "
                f"fields are {', '.join(sorted(known))}."
            )
        kwargs = dict(value)
        if kwargs.get("classifier_from_token") is not None:
            kwargs["classifier_from_token"] = tuple(kwargs["classifier_from_token"])
        return cls(**kwargs)


def parse_pooler_config(text: str) -> dict[str, object]:
    """``--pooler-config``: a JSON object of :class:`PoolerConfig`'s fields."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"expected a JSON object, got {text!r}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f'expected a JSON object such as {{"pooling_type": "MEAN"}}, got {text!r}')
    return value


@dataclass(frozen=True, slots=True)
class PoolingSetup:
    """What a pooling engine does with a prompt's hidden states.

    ``head``: ``None`` (an embedder), ``"score"`` (a sequence classifier's ``score.weight``)
    or ``"tokens"`` (the LM head's rows of ``head_tokens``); ``num_labels`` its outputs.
    ``matryoshka``: ``None`` (no truncation allowed), ``()`` (any size), or the sizes allowed.
    """

    pooling_type: str
    normalize: bool
    dimensions: int | None
    activation: bool
    head: str | None
    head_tokens: tuple[str, ...]
    qwen3_reranker: bool
    matryoshka: tuple[int, ...] | None

    @property
    def prefix_caching(self) -> bool:
        """Whether prompts may share cached blocks: only the last token's row is needed for
        LAST pooling (the last block is always computed); MEAN and CLS need every row."""
        return self.pooling_type == "LAST"

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> int | None:
        """``dimensions`` asked for an embedding (``None``: the configured default), checked."""
        wanted = self.dimensions if dimensions is None else dimensions
        if wanted is None or wanted == hidden_size:
            return None
        if self.matryoshka is None:
            raise ConfigurationError(
                f"dimensions={wanted}: this model does not support Matryoshka truncation "
                "(its config.json sets neither is_matryoshka nor matryoshka_dimensions); "
                "leave dimensions out."
            )
        allowed = self.matryoshka
        if not 1 <= wanted <= hidden_size or (allowed and wanted not in allowed):
            sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {hidden_size}"
            raise ConfigurationError(f"dimensions={wanted} is not allowed: expected {sizes}.")
        return wanted


def is_classifier_checkpoint(model_path: str) -> bool:
    """Whether the checkpoint's architecture is a ``*ForSequenceClassification``."""
    return any(
        name.endswith(_CLASSIFIER) for name in _config(Path(model_path)).get("architectures") or []
    )


def pooling_setup(runner: str, model_path: str, pooler_config: object) -> PoolingSetup | None:
    """The pooling of ``runner="pooling"`` (``None`` for a generating engine), from the
    checkpoint and ``pooler_config``; ``runner="auto"`` pools for a sequence classifier."""
    if runner not in RUNNERS:
        raise ConfigurationError(
            f"runner={runner!r} is not supported: expected one of {', '.join(RUNNERS)}."
        )
    root = Path(model_path)
    raw = _config(root)
    classifier = any(name.endswith(_CLASSIFIER) for name in raw.get("architectures") or [])
    if runner == "generate" and classifier:
        raise ConfigurationError(
            f"checkpoint {model_path!r} is a sequence classifier ({raw['architectures'][0]}): "
            "it cannot generate; pass runner='pooling'."
        )
    override = PoolerConfig.from_value(pooler_config)
    if runner == "generate" or (runner == "auto" and not classifier):
        if pooler_config is not None and override != PoolerConfig():
            raise ConfigurationError(
                "pooler_config is set but the engine generates: pass runner='pooling'."
            )
        return None
    pooling_type, normalize = _sentence_transformers_pooling(root)
    head = "score" if classifier else None
    if override.classifier_from_token:
        head = "tokens"
    matryoshka: tuple[int, ...] | None = None
    dims = raw.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        matryoshka = tuple(int(d) for d in dims)
    elif raw.get("is_matryoshka"):
        matryoshka = ()
    return PoolingSetup(
        pooling_type=(override.pooling_type or pooling_type).upper(),
        normalize=normalize if override.normalize is None else override.normalize,
        dimensions=override.dimensions,
        activation=True if override.activation is None else override.activation,
        head=head,
        head_tokens=override.classifier_from_token or (),
        qwen3_reranker=override.is_original_qwen3_reranker,
        matryoshka=matryoshka,
    )


def _config(root: Path) -> dict[str, Any]:
    try:
        raw = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _sentence_transformers_pooling(root: Path) -> tuple[str, bool]:
    """(pooling type, normalize) from ``modules.json``; a decoder's default without one."""
    try:
        modules = json.loads((root / "modules.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return "LAST", True
    pooling_type, normalize = "LAST", False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            try:
                config = json.loads(
                    (root / str(module.get("path", "")) / "config.json").read_text("utf-8")
                )
            except (OSError, json.JSONDecodeError) as error:
                raise ConfigurationError(
                    f"checkpoint {str(root)!r}: modules.json names a Pooling module whose "
                    f"config.json cannot be read ({error})."
                ) from error
            modes = [mode for key, mode in _ST_MODES.items() if config.get(key)]
            if len(modes) != 1:
                raise ConfigurationError(
                    f"checkpoint {str(root)!r}: its pooling config sets {modes or 'no mode'}; "
                    "pagedinfer pools with exactly one of pooling_mode_lasttoken, "
                    "pooling_mode_mean_tokens, pooling_mode_cls_token (override with "
                    "pooler_config={'pooling_type': ...})."
                )
            pooling_type = modes[0]
    return pooling_type, normalize
