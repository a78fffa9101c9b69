"""A choice's growing text as OpenAI's chat deltas: content, and tool calls piece by piece.

A call's first delta carries its ``index`` (its place among the choice's calls), ``id``,
``type: "function"`` and ``function.name`` (with the arguments so far, usually ``""``);
later deltas carry ``function.arguments`` fragments. Put together they give the calls of
the whole answer, as :meth:`~pagedinfer.serving.tools.formats.ToolCallFormat.extract` reads
them (ids aside: each call gets a fresh id).

Text that turns out malformed once a call's first deltas went out cannot be taken back: the
stream then ends by sending the rest of the text as content (the whole answer's content is
the text, and it has no call), with the engine's finish reason.
"""

from __future__ import annotations

from typing import Any

from pagedinfer.serving.tools.formats import Extracted, ToolCallFormat
from pagedinfer.serving.tools.scan import held_back

__all__ = ["ToolCallStream"]


class ToolCallStream:
    """The deltas of one choice (``parallel``: all its calls; otherwise only the first, as
    vLLM does with ``parallel_tool_calls=false``; ``end_texts``: texts dropped from the
    answer's end, such as EOS when it is decoded with its special tokens)."""

    __slots__ = ("_content", "_end_texts", "_format", "_ids", "_parallel", "_sent", "final")

    def __init__(
        self,
        format: ToolCallFormat,
        *,
        parallel: bool = True,
        end_texts: tuple[str, ...] = (),
    ) -> None:
        self._format = format
        self._parallel = parallel
        self._end_texts = tuple(end for end in end_texts if end)
        self._content = 0  # characters of content sent
        self._ids: list[str] = []
        self._sent: list[int] = []  # characters of arguments sent, per call
        self.final: Extracted | None = None  # the whole answer, once finished

    def advance(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool-call deltas that are new in ``text`` (the choice's whole
        text so far; ``final``: it is finished)."""
        text = self._visible(text, final)
        scan = self._format.scan(text, final)
        content_so_far = scan.content
        if final:
            self.final = extracted = self._format.extract(text)
            if not extracted.calls:
                content_so_far = text
        content = content_so_far[self._content :]
        self._content = max(self._content, len(content_so_far))
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(scan.calls):
            if (index and not self._parallel) or call.name is None:
                break
            if index == len(self._ids):
                self._ids.append(self._format.new_id())
                self._sent.append(len(call.arguments))
                deltas.append(
                    {
                        "index": index,
                        "id": self._ids[index],
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
                continue
            fragment = call.arguments[self._sent[index] :]
            if fragment:
                self._sent[index] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": fragment}})
        return content, deltas

    def _visible(self, text: str, final: bool) -> str:
        """``text`` without an end text at its end (while it may go on: without what could
        start one)."""
        for end in self._end_texts:
            if text.endswith(end):
                return text[: -len(end)]
        if not final and self._end_texts:
            return text[: len(text) - held_back(text, self._end_texts)]
        return text

    @property
    def called(self) -> bool:
        """Whether the finished answer made calls."""
        return self.final is not None and bool(self.final.calls)
