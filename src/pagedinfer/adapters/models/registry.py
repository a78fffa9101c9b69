"""Architecture name (``config.json: architectures``) -> model class, and model construction."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from pagedinfer.adapters.attention.base import AttentionBackend
from pagedinfer.adapters.distributed.parallel import ParallelContext

if TYPE_CHECKING:
    from pagedinfer.adapters.models.base import CausalLM
    from pagedinfer.adapters.models.config import ModelConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "build_model", "model_class"]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("Qwen3ForCausalLM",)


def model_class(architecture: str) -> type[CausalLM]:
    """The class implementing ``architecture`` (imported on first use)."""
    if architecture == "Qwen3ForCausalLM":
        from pagedinfer.adapters.models.qwen3 import Qwen3ForCausalLM

        return Qwen3ForCausalLM
    raise KeyError(
        f"no model class for {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def build_model(
    config: ModelConfig,
    *,
    parallel: ParallelContext,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """Construct the model with its parameters already on ``device`` in ``dtype``.

    Weights are uninitialised until the loader fills them. Creating each parameter where it
    will live avoids a float32 CPU copy of the whole model.
    """
    cls = model_class(config.architecture)
    with torch.device(device), _default_dtype(dtype):
        model = cls(config, parallel=parallel, backend=backend)
    return model.eval()


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Layers create parameters with torch.empty(shape); the default dtype decides theirs.
    # Scoped to construction and restored after, so no global state leaks out.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
