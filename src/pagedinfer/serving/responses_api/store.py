"""The responses the server keeps for ``previous_response_id`` and ``GET /v1/responses/{id}``:
a bounded, in-memory, least-recently-used store, one per app.

A response is kept when its request has ``store: true`` (OpenAI's default): its body and
its conversation (the messages it was answered from, without its ``instructions``, then its
answer as the assistant turn). The store holds at most ``max_responses`` responses and
``max_chars`` characters of them (the JSON of bodies and conversations); beyond either, the
least recently used go first. It lives in the server process: a restart forgets it, and
replicas behind a load balancer do not share it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_MAX_RESPONSES", "DEFAULT_MAX_STORED_CHARS", "ResponseStore", "StoredResponse"]

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_STORED_CHARS = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: Mapping[str, Any]
    conversation: Sequence[Mapping[str, Any]]
    size: int


class ResponseStore:
    """Stored responses by id (used from the event loop only: no lock)."""

    def __init__(
        self,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        max_chars: int = DEFAULT_MAX_STORED_CHARS,
    ) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, body: Mapping[str, Any], conversation: Sequence[Mapping[str, Any]]) -> None:
        response_id = str(body["id"])
        size = len(json.dumps(body)) + len(json.dumps(list(conversation)))
        self._drop(response_id)
        if size > self.max_chars:
            return  # larger than the whole store: not kept
        self._responses[response_id] = StoredResponse(body, conversation, size)
        self._chars += size
        while len(self._responses) > self.max_responses or self._chars > self.max_chars:
            oldest = next(iter(self._responses))
            self._drop(oldest)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def _drop(self, response_id: str) -> None:
        stored = self._responses.pop(response_id, None)
        if stored is not None:
            self._chars -= stored.size
