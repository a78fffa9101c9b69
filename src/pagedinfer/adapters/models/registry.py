"""The architectures pagedinfer runs: ``config.json: architectures[0]`` -> model class.

This is the top of ``adapters/models``: it imports every family, and nothing in the package
imports it. Callers read a checkpoint's config with :func:`read_model_config` (which refuses
unknown architectures early, before any weight is touched) and build the model with
:func:`build_model`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pagedinfer.adapters.attention.base import AttentionBackend
from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.models.base import BuildContext, CausalLM
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.gemma3 import Gemma3ForCausalLM
from pagedinfer.adapters.models.gpt_oss import GptOssForCausalLM
from pagedinfer.adapters.models.llama import LlamaForCausalLM
from pagedinfer.adapters.models.loader import is_bare_decoder
from pagedinfer.adapters.models.mistral import MistralForCausalLM
from pagedinfer.adapters.models.qwen2 import Qwen2ForCausalLM
from pagedinfer.adapters.models.qwen3 import Qwen3ForCausalLM
from pagedinfer.adapters.models.qwen3_moe import Qwen3MoeForCausalLM
from pagedinfer.errors import UnsupportedModelError

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "build_model",
    "model_class",
    "read_model_config",
]

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The class implementing ``config.architecture``, after its family-specific checks.

    Raises :class:`UnsupportedModelError` naming the checkpoint and the supported names.
    """
    cls = ARCHITECTURES.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(
            f"checkpoint {str(config.path)!r}: architecture {config.architecture!r} is not "
            f"supported; expected one of: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    cls.check_config(config)
    return cls


def read_model_config(path: str | Path) -> ModelConfig:
    """:meth:`ModelConfig.from_pretrained` plus the architecture check."""
    config = ModelConfig.from_pretrained(path)
    if not config.tie_word_embeddings and is_bare_decoder(config.path):
        # The decoder alone (Qwen3-Embedding-4B/8B): no LM head to load; pooling never uses it.
        config = dataclasses.replace(config, tie_word_embeddings=True)
    model_class(config)
    return config


def build_model(
    config: ModelConfig,
    *,
    parallel: ParallelContext,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """Construct the model with its parameters already on ``device`` in ``dtype``.

    Weights are uninitialised until the loader fills them. Every parameter is created where
    it will live, in its dtype (no float32 CPU copy of the whole model, and no process-wide
    torch default is read or changed).
    """
    cls = model_class(config)
    build = BuildContext(parallel=parallel, backend=backend, dtype=dtype, device=device)
    return cls(config, build).eval()
