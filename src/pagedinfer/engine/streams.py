"""``RequestStream``: the iterator :meth:`pagedinfer.Engine.stream` returns."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.engine.requests import RequestState
from pagedinfer.errors import EngineClosedError

__all__ = ["RequestStream"]


class _StreamSource(Protocol):
    """What a stream needs from the engine (kept narrow so the two stay decoupled)."""

    def _next_stream_delta(self, request: RequestState) -> RequestOutput: ...

    def abort(self, request_id: str) -> bool: ...

    def _abandon(self, request_id: int) -> None: ...


class RequestStream(Iterator[RequestOutput]):
    """The deltas of one request (``RequestOutput`` s holding only what is new), ending with
    the one whose ``finished`` is True.

    The request is queued when the stream is created. ``close()`` (or leaving the loop with
    ``break`` and dropping the stream) aborts it if it has not finished; an exception raised
    while the stream waits for its next delta (a failing step, Ctrl-C) aborts it too.
    """

    __slots__ = ("_done", "_request", "_source", "request_id")

    def __init__(self, source: _StreamSource, request: RequestState) -> None:
        self._source = source
        self._request = request
        self.request_id = request.name  # RequestOutput.request_id, what abort takes
        self._done = False

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        if self._done:
            raise StopIteration
        try:
            delta = self._source._next_stream_delta(self._request)
        except BaseException:
            self.close()
            raise
        if delta.finished:
            self._done = True
        return delta

    def close(self) -> None:
        """Abort the request unless it already finished. Idempotent."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(EngineClosedError):  # closing the engine ended it already
            self._source.abort(self.request_id)

    def __del__(self) -> None:
        # Garbage collection may run while this very thread holds the engine's lock, so the
        # abort is only queued here; the engine carries it out at its next call.
        if not self._done:
            self._done = True
            self._source._abandon(self._request.request_id)
