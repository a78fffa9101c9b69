"""The public engine: tokenizer, request loop, progress and metrics on top of the adapters."""

from pagedinfer.engine.async_engine import AsyncEngine, AsyncRequestStream
from pagedinfer.engine.engine import Engine, EngineStats
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedinfer.engine.prompts import TokenizedPrompt

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
