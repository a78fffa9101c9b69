"""The public engine: tokenizer, request loop, progress and metrics on top of the adapters."""

from pagedinfer._extras import require_engine_extra

require_engine_extra("pagedinfer.engine (Engine, LLM, AsyncEngine)")

# After the check: each of these imports torch.
from pagedinfer.engine.async_engine import AsyncEngine, AsyncRequestStream  # noqa: E402
from pagedinfer.engine.engine import Engine, EngineStats  # noqa: E402
from pagedinfer.engine.llm import LLM  # noqa: E402
from pagedinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from pagedinfer.engine.prompts import TokenizedPrompt  # noqa: E402

__all__ = [
    "LLM",
    "AsyncEngine",
    "AsyncRequestStream",
    "CompletionOutput",
    "Engine",
    "EngineStats",
    "Logprob",
    "RequestOutput",
    "TokenizedPrompt",
]
