"""uvicorn's HTTP/1.1 protocol (httptools) with a deadline and a size cap on request headers.

uvicorn closes a connection that stays idle ``timeout_keep_alive`` seconds *between*
requests, but it has no limit on how long a request's headers may take: a client that opens a
connection and sends nothing, or half a request line, holds it forever. Here every request
(the first from the moment the connection opens, the next ones from their first byte) must
deliver its request line and headers within ``header_timeout_s``, and at most
``max_header_bytes`` of them, or the connection is closed. The body's deadline is the
:class:`~pagedinfer.serving.guard.RequestGuard`'s.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pagedinfer.serving.options import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_HEADER_BYTES

__all__ = ["HeaderLimitedProtocol", "protocol_class"]


class _HeadersTooLarge(Exception):
    """Raised from a parser callback: httptools turns it into a parse error, which uvicorn
    answers with 400 and a closed connection."""


class HeaderLimitedProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` whose request headers have a deadline and a size cap (class
    attributes: make a configured subclass with :func:`protocol_class`)."""

    header_timeout_s: ClassVar[float] = DEFAULT_HEADER_TIMEOUT_S
    max_header_bytes: ClassVar[int] = DEFAULT_MAX_HEADER_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._header_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # the first request line must come in time too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.max_header_bytes:
            self._disarm()
            raise _HeadersTooLarge

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _expired(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers did not arrive in time")
            self.transport.close()


def protocol_class(header_timeout_s: float, max_header_bytes: int) -> type[HeaderLimitedProtocol]:
    """A :class:`HeaderLimitedProtocol` with these limits (uvicorn's ``Config(http=...)``)."""
    return type(
        "HeaderLimitedProtocol",
        (HeaderLimitedProtocol,),
        {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes},
    )
