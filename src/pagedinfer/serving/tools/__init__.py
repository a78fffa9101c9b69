"""Tool calling for ``/v1/chat/completions`` (pure Python; docs/serving.md, "Tool calling").

* :mod:`~pagedinfer.serving.tools.choice`: what ``tools``, ``tool_choice`` and
  ``parallel_tool_calls`` ask for (:func:`plan_tools`): the template's tools, the JSON-schema
  constraint of ``"required"`` and named functions, how calls are read and reported
  (:class:`ToolCalls`), and the history's ``tool_calls`` arguments as templates expect them.
* :mod:`~pagedinfer.serving.tools.formats`: the families' text formats (``--tool-call-parser``
  ``hermes``, ``llama3_json``, ``llama4_json``, ``mistral``), read from generated text;
  :mod:`~pagedinfer.serving.tools.qwen3_coder`: Qwen3-Coder's XML calls (``qwen3_coder``);
  :mod:`~pagedinfer.serving.tools.parsers`: the formats by name.
* :mod:`~pagedinfer.serving.tools.stream`: a choice's growing text as OpenAI's content and
  tool-call deltas.
* :mod:`~pagedinfer.serving.tools.scan`: JSON objects read while they are generated.
"""

from __future__ import annotations

from pagedinfer.serving.tools.choice import (
    ToolCalls,
    ToolPlan,
    plan_tools,
    template_messages,
    template_tools,
)
from pagedinfer.serving.tools.formats import Extracted, ParsedCall, ToolCallFormat
from pagedinfer.serving.tools.parsers import TOOL_CALL_PARSERS, tool_call_format
from pagedinfer.serving.tools.stream import ToolCallStream

__all__ = [
    "TOOL_CALL_PARSERS",
    "Extracted",
    "ParsedCall",
    "ToolCallFormat",
    "ToolCallStream",
    "ToolCalls",
    "ToolPlan",
    "plan_tools",
    "template_messages",
    "template_tools",
    "tool_call_format",
]
