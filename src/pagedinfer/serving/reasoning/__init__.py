"""Reasoning parsers (``--reasoning-parser``; docs/serving.md, "Reasoning"): a thinking
model's answer split into ``reasoning_content`` and ``content``, whole or streamed.

* :mod:`~pagedinfer.serving.reasoning.parsers`: :class:`ReasoningParser` (``thinking``:
  whether an answer starts in reasoning; ``split``: a text's reasoning and content;
  ``stream``: a :class:`ReasoningStream` of deltas) and the families.
* :mod:`~pagedinfer.serving.reasoning.registry`: the parsers by name
  (:func:`get_reasoning_parser`).
"""

from __future__ import annotations

from pagedinfer.serving.reasoning.parsers import (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    Qwen3ReasoningParser,
    Reasoned,
    ReasoningDelta,
    ReasoningParser,
    ReasoningStream,
)
from pagedinfer.serving.reasoning.registry import REASONING_PARSERS, get_reasoning_parser

__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "DeepSeekV3ReasoningParser",
    "Qwen3ReasoningParser",
    "Reasoned",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
]
