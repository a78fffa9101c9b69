"""``--tool-call-parser NAME``: the tool-call formats by name (vLLM's names)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedinfer.serving.tools.formats import (
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    ToolCallFormat,
)
from pagedinfer.serving.tools.qwen3_coder import Qwen3CoderFormat

__all__ = ["TOOL_CALL_PARSERS", "tool_call_format"]

TOOL_CALL_PARSERS: dict[str, type[ToolCallFormat]] = {
    "hermes": HermesFormat,
    "llama3_json": Llama3JsonFormat,
    "llama4_json": Llama3JsonFormat,
    "mistral": MistralFormat,
    "qwen3_coder": Qwen3CoderFormat,
}


def tool_call_format(name: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ToolCallFormat:
    """The format ``--tool-call-parser NAME`` names, for a request's ``tools`` (some formats
    convert arguments by their schemas); a ``KeyError`` for another name."""
    return TOOL_CALL_PARSERS[name].for_tools(tools)
