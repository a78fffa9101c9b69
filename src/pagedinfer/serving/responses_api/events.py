"""A streamed response as the Responses API's server-sent events.

Each event is ``event: <type>`` and ``data: <json>`` whose ``sequence_number`` counts from 0:
``response.created`` and ``response.in_progress`` first; then per output item
``response.output_item.added``, its content (a reasoning item: ``response.content_part.added``,
``response.reasoning_text.delta``..., ``response.reasoning_text.done``,
``response.content_part.done``; a message: the same with ``response.output_text.delta`` /
``.done``; a function call: ``response.function_call_arguments.delta``... and ``.done``) and
``response.output_item.done``; one item is closed before the next opens. The stream ends
with ``response.completed`` whose ``response`` holds every item and the usage (its status
``incomplete`` when ``max_output_tokens`` cut it: vLLM's event, and the one the ``openai``
client's stream helper waits for), or (a failure) ``error`` then
``response.failed``. There is no ``[DONE]``, as in OpenAI's API.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedinfer.serving.responses import Completion, Prompt
from pagedinfer.serving.responses_api.output import (
    ResponseShape,
    function_call_item,
    message_item,
    new_id,
    output_text_part,
    reasoning_item,
    response_usage,
)
from pagedinfer.serving.tools import ToolCalls, ToolCallStream
from pagedinfer.serving.translated import Reasoner, split_answer

__all__ = ["ResponseEvents", "event"]


def event(body: dict[str, Any]) -> str:
    """One server-sent event, named by its ``type``."""
    return f"event: {body['type']}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


@dataclass(slots=True)
class _Item:
    kind: str  # "reasoning", "message" or "function_call"
    item_id: str
    index: int  # output_index
    text: str = ""  # the reasoning, the message's text, or the call's arguments
    call_id: str = ""
    name: str = ""


class ResponseEvents:
    """The events of one streamed response, from its answer's growing text."""

    def __init__(
        self, shape: ResponseShape, tools: ToolCalls | None, reasoner: Reasoner | None
    ) -> None:
        self._shape = shape
        self._tools: ToolCallStream | None = None if tools is None else tools.stream()
        self._reasoner = reasoner
        self._sequence = 0
        self._items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}  # a tool-call delta's index -> its item
        self._reasoning = 0  # characters of reasoning sent
        self._content = 0  # characters of content read (without tools)
        self._pending = ""  # leading whitespace held until the message shows text
        self.output: list[dict[str, Any]] = []  # the finished items, for the final body
        self.final_body: dict[str, Any] | None = None  # the whole response, once finished

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event(body)

    def started(self) -> list[str]:
        body = self._shape.body("in_progress", [], None)
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def advance(self, completion: Completion) -> list[str]:
        """The events for what is new in ``completion`` (cumulative so far)."""
        final = completion.finish_reason is not None
        split = split_answer(completion.text, self._reasoner, final)
        events: list[str] = []
        reasoning = split.reasoning[self._reasoning :]
        if reasoning:
            self._reasoning = len(split.reasoning)
            item = self._item("reasoning", events)
            item.text += reasoning
            events.append(self._delta("response.reasoning_text.delta", item, reasoning))
        if self._tools is not None:
            content, deltas = self._tools.advance(split.content, final)
        else:
            content, deltas = split.content[self._content :], []
            self._content = len(split.content)
        self._text(content, events, flush=final and not self._calls and not deltas)
        for delta in deltas:
            self._call(delta, events)
        if final:
            status = "incomplete" if completion.finish_reason == "length" else "completed"
            shown = any(item.kind in ("message", "reasoning") for item in self._items)
            if not shown and not self._calls:
                self._item("message", events)
            self._close(events, status)
        return events

    def finished(
        self, prompt: Prompt, completion: Completion, reasoning_tokens: int = 0
    ) -> list[str]:
        """The stream's last event: the whole response."""
        incomplete = "max_output_tokens" if completion.finish_reason == "length" else None
        status = "completed" if incomplete is None else "incomplete"
        usage = response_usage(prompt, completion, reasoning_tokens)
        body = self._shape.body(status, self.output, usage, incomplete)
        self.final_body = body
        return [self._event("response.completed", response=body)]

    def failed(self, error: dict[str, Any]) -> list[str]:
        """The events that end a failed stream (``error``: OpenAI's error object)."""
        body = self._shape.body("failed", self.output, None, error=error)
        return [
            self._event(
                "error", code=error.get("code"), message=error["message"], param=error.get("param")
            ),
            self._event("response.failed", response=body),
        ]

    # ------------------------------------------------------------------- items
    def _text(self, text: str, events: list[str], *, flush: bool) -> None:
        open_message = self._open is not None and self._open.kind == "message"
        if not open_message:
            # Whitespace before a tool call is no message: hold it until text shows.
            self._pending += text
            if not self._pending.strip() and not (flush and self._pending):
                return
            text, self._pending = self._pending, ""
        if not text:
            return
        item = self._item("message", events)
        item.text += text
        events.append(self._delta("response.output_text.delta", item, text, logprobs=[]))

    def _call(self, delta: dict[str, Any], events: list[str]) -> None:
        function = delta.get("function", {})
        if "id" in delta:
            self._close(events, "completed")
            item = _Item(
                "function_call",
                new_id("fc"),
                len(self._items),
                call_id=delta["id"],
                name=function.get("name", ""),
            )
            self._items.append(item)
            self._open = item
            self._calls[delta["index"]] = item
            added = function_call_item(item.item_id, item.call_id, item.name, "", "in_progress")
            events.append(
                self._event("response.output_item.added", output_index=item.index, item=added)
            )
        item = self._calls[delta["index"]]
        fragment = function.get("arguments") or ""
        if fragment:
            item.text += fragment
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.item_id,
                    output_index=item.index,
                    delta=fragment,
                )
            )

    def _item(self, kind: str, events: list[str]) -> _Item:
        """The open item of ``kind`` (the one open before closed, a new one opened)."""
        if self._open is not None and self._open.kind == kind:
            return self._open
        self._close(events, "completed")
        prefix = "rs" if kind == "reasoning" else "msg"
        item = _Item(kind, new_id(prefix), len(self._items))
        self._items.append(item)
        self._open = item
        if kind == "reasoning":
            added, part = (
                reasoning_item(item.item_id, None, "in_progress"),
                {
                    "type": "reasoning_text",
                    "text": "",
                },
            )
        else:
            added, part = message_item(item.item_id, None, "in_progress"), output_text_part("")
        events.append(
            self._event("response.output_item.added", output_index=item.index, item=added)
        )
        events.append(
            self._event(
                "response.content_part.added",
                item_id=item.item_id,
                output_index=item.index,
                content_index=0,
                part=part,
            )
        )
        return item

    def _close(self, events: list[str], status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        where = {"item_id": item.item_id, "output_index": item.index}
        done: dict[str, Any]
        if item.kind == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item.name,
                    arguments=item.text,
                )
            )
            done = function_call_item(item.item_id, item.call_id, item.name, item.text, "completed")
        else:
            if item.kind == "reasoning":
                text_done, part = (
                    "response.reasoning_text.done",
                    {
                        "type": "reasoning_text",
                        "text": item.text,
                    },
                )
                done = reasoning_item(item.item_id, item.text, "completed")
                extra: dict[str, Any] = {}
            else:
                text_done, part = "response.output_text.done", output_text_part(item.text)
                done = message_item(item.item_id, item.text, status)
                extra = {"logprobs": []}
            events.append(self._event(text_done, **where, content_index=0, text=item.text, **extra))
            events.append(
                self._event("response.content_part.done", **where, content_index=0, part=part)
            )
        events.append(self._event("response.output_item.done", output_index=item.index, item=done))
        self.output.append(done)

    def _delta(self, kind: str, item: _Item, delta: str, **extra: Any) -> str:
        return self._event(
            kind,
            item_id=item.item_id,
            output_index=item.index,
            content_index=0,
            delta=delta,
            **extra,
        )
