"""Reasoning parsers: a thinking model's answer split into its reasoning and its content.

Thinking models (Qwen3, QwQ, DeepSeek-R1 and its distills) write their reasoning between
``<think>`` and ``</think>`` before the answer; the chat templates of newer checkpoints put
``<think>`` in the prompt, so the generated text often holds only ``</think>``. A parser
reads the generated text (``--reasoning-parser NAME``, vLLM's names):

* text before the first ``</think>`` is the reasoning (a ``<think>`` that opens the text,
  after any whitespace, is dropped); the text after it is the content;
* text without ``</think>`` is all reasoning: the model stopped mid-thought
  (``max_tokens``) and the content is empty, as vLLM answers;
* when the answer does not start in reasoning (:meth:`ReasoningParser.thinking` says so: the
  prompt already closed the think block, as Qwen3's template does with
  ``enable_thinking=false``, or Qwen3's ``enable_thinking`` is false), the whole text is
  content and nothing is parsed.

A split is a pure function of the text and only ever grows as the text grows (a tail that
could still become ``</think>`` or ``<think>`` is held back until the next characters tell),
so a stream (:class:`ReasoningStream`) sends each split's new parts as deltas and they add
up to the whole answer's split.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pagedinfer.serving.tools.scan import held_back, skip_space

__all__ = [
    "DeepSeekR1ReasoningParser",
    "DeepSeekV3ReasoningParser",
    "Qwen3ReasoningParser",
    "Reasoned",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStream",
]


@dataclass(frozen=True, slots=True)
class Reasoned:
    """An answer's parts: ``reasoning`` (``None``: the answer does not reason at all),
    ``content`` (``""`` when there is none yet) and whether the reasoning has ``ended``
    (its end marker was generated, or the answer does not reason)."""

    reasoning: str | None
    content: str
    ended: bool


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """What one step of a stream adds to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser(ABC):
    """A family's reasoning markers and when its answers start in reasoning."""

    name: ClassVar[str]
    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"

    def thinking(
        self,
        prompt: str | None,
        template_kwargs: Mapping[str, Any] | None,
        *,
        continued: bool = False,
    ) -> bool:
        """Whether an answer to ``prompt`` (the rendered chat; ``None`` when unknown) starts
        in reasoning: not when the prompt ends with the end marker (the template closed
        the think block: vLLM's ``prompt_is_reasoning_end``, looked for at the prompt's end
        only, so that a previous turn's reasoning kept in the history does not count).
        ``continued``: the answer continues the prompt's last message
        (``continue_final_message``), which is in reasoning only if its last marker is the
        start marker."""
        if prompt is None:
            return True
        if continued:
            return prompt.rfind(self.start_marker) > prompt.rfind(self.end_marker)
        return not prompt.rstrip().endswith(self.end_marker)

    def split(
        self,
        text: str,
        *,
        thinking: bool = True,
        final: bool = True,
        end_texts: tuple[str, ...] = (),
        resume: int = 0,
    ) -> Reasoned:
        """The reasoning and content of ``text`` (``final``: the answer is finished; else
        a tail that could still become a marker is held back). ``end_texts``: texts that may
        end the answer (EOS decoded with special tokens), dropped from the end of a
        reasoning that never ended. ``resume``: the length of a reasoning an earlier split
        of the same growing text gave (the markers are looked for after it, so that a
        stream does not read the whole text again at every step)."""
        if not thinking:
            return Reasoned(None, text, True)
        first = skip_space(text, 0)
        start = 0
        if text.startswith(self.start_marker, first):
            start = first + len(self.start_marker)
        elif (
            not final
            and len(text) - first < len(self.start_marker)
            and self.start_marker.startswith(text[first:])
        ):
            return Reasoned("", "", False)  # the start marker may be coming
        body = text[start:]
        end = body.find(self.end_marker, resume)
        call, decided = self._call_opening(body, len(body) if end < 0 else end, final, resume)
        if call >= 0 and decided:  # the answer began with a tool call, the thought unclosed
            return Reasoned(body[:call], body[call:], True)
        if call >= 0:  # it may: hold the rest back until the next characters tell
            return Reasoned(body[:call], "", False)
        if end >= 0:
            return Reasoned(body[:end], body[end + len(self.end_marker) :], True)
        for end_text in end_texts:
            if end_text and body.endswith(end_text):
                return Reasoned(body[: -len(end_text)], "", False)
        if final:
            return Reasoned(body, "", False)
        markers = (self.end_marker, *(end for end in end_texts if end))
        return Reasoned(body[: len(body) - held_back(body, markers)], "", False)

    def _call_opening(
        self, body: str, limit: int, final: bool, resume: int = 0
    ) -> tuple[int, bool]:
        """Where a tool call that implicitly ends the reasoning opens in
        ``body[resume:limit]`` (-1: none) and whether it is decided (``False``: the text may
        still turn into one). None for this family (see :class:`Qwen3ReasoningParser`)."""
        del body, limit, final, resume
        return -1, False

    def stream(self, *, thinking: bool = True, end_texts: tuple[str, ...] = ()) -> ReasoningStream:
        """A stream of one answer's reasoning and content deltas."""
        return ReasoningStream(self, thinking=thinking, end_texts=end_texts)


class ReasoningStream:
    """One answer's growing text as reasoning and content deltas (:meth:`advance`); the
    content so far (:attr:`content`) is what a tool-call parser reads."""

    __slots__ = ("_end_texts", "_parser", "_reasoning", "_thinking", "content", "last")

    def __init__(
        self, parser: ReasoningParser, *, thinking: bool = True, end_texts: tuple[str, ...] = ()
    ) -> None:
        self._parser = parser
        self._thinking = thinking
        self._end_texts = end_texts
        self._reasoning = 0  # characters of reasoning sent
        self.content = ""  # the content so far
        self.last: Reasoned | None = None

    def advance(self, text: str, final: bool) -> ReasoningDelta:
        """The reasoning and content that are new in ``text`` (the answer's whole text so
        far; ``final``: it is finished)."""
        split = self._parser.split(
            text,
            thinking=self._thinking,
            final=final,
            end_texts=self._end_texts,
            resume=self._reasoning,
        )
        self.last = split
        reasoning = split.reasoning or ""
        new_reasoning = reasoning[self._reasoning :]
        self._reasoning = max(self._reasoning, len(reasoning))
        new_content = split.content[len(self.content) :]
        if len(split.content) > len(self.content):
            self.content = split.content
        return ReasoningDelta(new_reasoning, new_content)

    @property
    def ended(self) -> bool:
        """Whether the reasoning has ended (the content has begun)."""
        return self.last is not None and self.last.ended


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 / QwQ / Qwen3.5 (``--reasoning-parser qwen3``): ``<think>...</think>``, and the
    template's ``enable_thinking`` (``chat_template_kwargs``): false makes the whole answer
    content (vLLM's rule), whatever the template rendered.

    Qwen3.5 may start a tool call inside its thought without closing it: a ``<tool_call>``
    followed (after whitespace) by ``<function=`` or ``<function `` ends the reasoning, and
    the content starts at the ``<tool_call>`` (vLLM's rule); a ``<tool_call>`` followed by
    anything else is reasoning text."""

    name = "qwen3"
    CALL = "<tool_call>"
    FUNCTION = "<function"

    def _call_opening(
        self, body: str, limit: int, final: bool, resume: int = 0
    ) -> tuple[int, bool]:
        position = body.find(self.CALL, resume, limit)
        while position >= 0:
            start = skip_space(body, position + len(self.CALL))
            after = body[start : start + len(self.FUNCTION) + 1]  # what decides, no more
            if after.startswith(self.FUNCTION):
                following = after[len(self.FUNCTION) : len(self.FUNCTION) + 1]
                if following in ("=", " ", "\t", "\n"):
                    return position, True
                if not following and not final:
                    return position, False
            elif not final and self.FUNCTION.startswith(after):
                return position, False
            position = body.find(self.CALL, position + 1, limit)
        if not final and limit == len(body):  # a tail that may still become "<tool_call>"
            held = held_back(body, (self.CALL,))
            if held:
                return len(body) - held, False
        return -1, False

    def thinking(
        self,
        prompt: str | None,
        template_kwargs: Mapping[str, Any] | None,
        *,
        continued: bool = False,
    ) -> bool:
        if template_kwargs is not None and not template_kwargs.get("enable_thinking", True):
            return False
        return super().thinking(prompt, template_kwargs, continued=continued)


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills (``--reasoning-parser deepseek_r1``):
    ``<think>...</think>``, the opening tag usually in the prompt."""

    name = "deepseek_r1"


class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    """DeepSeek-V3.1 / V3.2, hybrid models (``--reasoning-parser deepseek_v3``): they think
    only when the template's ``thinking`` variable is true (``chat_template_kwargs``; note:
    not ``enable_thinking``), then as DeepSeek-R1; otherwise the whole answer is content
    (vLLM's rule)."""

    name = "deepseek_v3"

    def thinking(
        self,
        prompt: str | None,
        template_kwargs: Mapping[str, Any] | None,
        *,
        continued: bool = False,
    ) -> bool:
        if template_kwargs is None or not template_kwargs.get("thinking", False):
            return False
        return super().thinking(prompt, template_kwargs, continued=continued)
