"""``--reasoning-parser NAME``: the parsers by name (vLLM's names)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pagedinfer.errors import ConfigurationError
from pagedinfer.serving.reasoning.parsers import (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
)

__all__ = ["REASONING_PARSERS", "get_reasoning_parser"]

REASONING_PARSERS: Mapping[str, type[ReasoningParser]] = MappingProxyType(
    {
        parser.name: parser
        for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser, DeepSeekV3ReasoningParser)
    }
)
"""The reasoning parsers by their ``--reasoning-parser`` name."""


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser ``name`` names; a :class:`~pagedinfer.errors.ConfigurationError` listing
    the names for another."""
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ConfigurationError(
            f"reasoning parser {name!r} is unknown: expected one of "
            f"{', '.join(sorted(REASONING_PARSERS))} (--reasoning-parser)."
        )
    return parser()
