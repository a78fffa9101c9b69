"""pagedinfer: fast offline LLM inference on a paged KV cache.

``from pagedinfer import Engine, SamplingParams``, or vLLM's entry point:
``from pagedinfer import LLM, SamplingParams``. Importing the package does not import torch:
``Engine``, ``LLM`` (and everything else that needs torch) are loaded on first access, so the
pure-Python :mod:`pagedinfer.domain` works where torch is not installed (``pip install .``
in the checkout; the engine needs ``pip install '.[engine]'``, and says so with a
:class:`~pagedinfer.errors.MissingDependencyError` when it is missing). ``dir(pagedinfer)``
lists the public names (``__all__``) and ``__version__``.

Type checkers see the engine's names through the imports below, which makes them analyse the
engine and torch for any code that imports ``pagedinfer.domain`` too. Code that uses only the
domain skips that with ``mypy --always-true=PAGEDINFER_DOMAIN_ONLY`` (or ``always_true =
["PAGEDINFER_DOMAIN_ONLY"]`` in its mypy configuration); the engine's names are then ``Any``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedinfer.domain.beam_search import BeamSearchParams
from pagedinfer.domain.grammar_limits import GrammarLimits
from pagedinfer.domain.lora import LoRARequest
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.sequence import FinishReason
from pagedinfer.domain.structured import GuidedDecodingParams, StructuredOutputsParams

# Always False when the code runs; a type checker told it is true skips the engine (above).
PAGEDINFER_DOMAIN_ONLY = False

if TYPE_CHECKING and not PAGEDINFER_DOMAIN_ONLY:
    from pagedinfer.engine.async_engine import AsyncEngine
    from pagedinfer.engine.beam_search import BeamSearchOutput, BeamSearchSequence
    from pagedinfer.engine.engine import Engine
    from pagedinfer.engine.llm import LLM
    from pagedinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from pagedinfer.engine.pooling import (
        ClassificationRequestOutput,
        EmbeddingRequestOutput,
        PoolingParams,
        ScoringRequestOutput,
    )
    from pagedinfer.engine.pooling_setup import PoolerConfig
    from pagedinfer.engine.prompts import TokenizedPrompt
    from pagedinfer.engine.streams import RequestStream

__all__ = [
    "LLM",
    "AsyncEngine",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "Engine",
    "FinishReason",
    "GrammarLimits",
    "GuidedDecodingParams",
    "LoRARequest",
    "Logprob",
    "PoolerConfig",
    "PoolingParams",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "TokenizedPrompt",
]
__version__ = "0.1.0"

_LAZY = {
    "AsyncEngine": "pagedinfer.engine.async_engine",
    "BeamSearchOutput": "pagedinfer.engine.beam_search",
    "BeamSearchSequence": "pagedinfer.engine.beam_search",
    "Engine": "pagedinfer.engine.engine",
    "LLM": "pagedinfer.engine.llm",
    "CompletionOutput": "pagedinfer.engine.outputs",
    "Logprob": "pagedinfer.engine.outputs",
    "RequestOutput": "pagedinfer.engine.outputs",
    "RequestStream": "pagedinfer.engine.streams",
    "TokenizedPrompt": "pagedinfer.engine.prompts",
    "ClassificationRequestOutput": "pagedinfer.engine.pooling",
    "EmbeddingRequestOutput": "pagedinfer.engine.pooling",
    "PoolingParams": "pagedinfer.engine.pooling",
    "ScoringRequestOutput": "pagedinfer.engine.pooling",
    "PoolerConfig": "pagedinfer.engine.pooling_setup",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'pagedinfer' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
