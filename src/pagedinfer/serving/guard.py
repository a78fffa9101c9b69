"""The door of the server: Host check, API key, bounded body; then the app.

:class:`RequestGuard` is a plain ASGI middleware in front of the FastAPI app. For every
HTTP request, before the app sees it:

1. the request must carry one ``Host`` header, well formed (``host`` or ``host:port``, read
   strictly by :mod:`pagedinfer.serving.hosts`) and naming an allowed host (against DNS
   rebinding), else 400 (a repeated or malformed ``Host`` is refused even when any host is
   allowed);
2. with an API key, every route but ``/health`` and ``/version`` (and ``/metrics`` if
   public) needs ``Authorization: Bearer <key>``, compared in constant time, else 401;
3. the body is read whole, at most ``max_request_bytes`` (a ``Content-Length`` over it is a
   413 before a byte is read; a chunked body is counted as it comes) and within
   ``body_timeout_s`` (else 408); the app then gets it in one message.

A refusal is OpenAI's error JSON with ``Connection: close`` (the rest of the body is never
read). An exception no handler turned into a response is logged with its traceback and
answered with a generic 500: its text never reaches the client.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pagedinfer.serving.errors import INTERNAL_ERROR_MESSAGE, error_body, logger
from pagedinfer.serving.hosts import admits_host
from pagedinfer.serving.options import ServingOptions

__all__ = ["RequestGuard"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Routes anyone may call, with or without the key (vLLM leaves these two open too: probes
# and version checks run before a client has a key).
_OPEN_PATHS = frozenset({"/health", "/version"})


class RequestGuard:
    """ASGI middleware enforcing :class:`ServingOptions` (see the module docstring).

    ``on_reject(status)`` is called for every request it refuses (metrics).
    """

    def __init__(
        self,
        app: ASGIApp,
        options: ServingOptions,
        on_reject: Callable[[int], None] | None = None,
    ) -> None:
        self.app = app
        self.options = options
        self.on_reject = on_reject
        self._open = _OPEN_PATHS | ({"/metrics"} if options.metrics_public else set())
        key = options.api_key
        # Compared as digests: equal length whatever the client sends, so the comparison
        # time says nothing about the key (hmac.compare_digest is constant-time).
        self._key_digest = None if key is None else _digest(key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        allowed = self.options.allowed_hosts
        version = str(scope.get("http_version", "1.1"))
        if not admits_host(scope.get("headers", ()), allowed, http_version=version):
            await self._refuse(
                send,
                400,
                "The Host header is malformed, repeated or does not name a host this server "
                "answers to: send one Host header, 'name' or 'name:port' ('[IPv6]' or "
                "'[IPv6]:port'), naming one of its --allowed-hosts.",
                code="invalid_host",
            )
            return
        if not self._authorized(scope["path"], headers.get("authorization")):
            await self._refuse(
                send,
                401,
                "Missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
                "with the server's key.",
                code="invalid_api_key",
                extra_headers=[(b"www-authenticate", b"Bearer")],
            )
            return
        body = await self._read_body(headers, receive, send)
        if body is None:
            return
        await self._run(scope, _replay(body, receive), send)

    # ------------------------------------------------------------------ checks
    def _authorized(self, path: str, header: str | None) -> bool:
        if self._key_digest is None or path in self._open:
            return True
        scheme, _, token = (header or "").strip().partition(" ")
        given = _digest(token.strip().encode())
        # Both compared whatever the scheme, so a wrong scheme takes as long as a wrong key.
        return hmac.compare_digest(given, self._key_digest) and scheme.lower() == "bearer"

    async def _read_body(
        self, headers: dict[str, str], receive: Receive, send: Send
    ) -> bytes | None:
        """The whole body, or None after answering 413 / 408 / 400 (or a disconnect)."""
        limit = self.options.max_request_bytes
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                await self._refuse(send, 400, "The Content-Length header is not a number.")
                return None
            if int(length) > limit:
                await self._too_large(send)
                return None
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                await self._refuse(
                    send,
                    408,
                    f"The request body did not arrive within {self.options.body_timeout_s:g} "
                    "seconds.",
                    code="request_timeout",
                )
                return None
            if message["type"] != "http.request":
                return None  # the client disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(send)
                return None
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send: Send) -> None:
        limit = self.options.max_request_bytes
        await self._refuse(
            send,
            413,
            f"The request body is larger than this server's limit of {limit} bytes: send a "
            "smaller request (the operator can raise --max-request-bytes).",
            code="request_too_large",
        )

    # ------------------------------------------------------------------ the app
    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as error:
            if started:  # nothing to answer with: uvicorn logs it and closes the connection
                raise
            logger.error(
                "unexpected error while serving %s %s",
                scope.get("method"),
                scope.get("path"),
                exc_info=error,
            )
            await self._refuse(send, 500, INTERNAL_ERROR_MESSAGE, kind="server_error")

    async def _refuse(
        self,
        send: Send,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        if self.on_reject is not None:
            self.on_reject(status)
        payload = json.dumps(error_body(message, kind, None, code)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                    *(extra_headers or []),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})


def _headers(scope: Scope) -> dict[str, str]:
    """The headers a check reads (the first of each name), decoded as Latin-1."""
    wanted = (b"authorization", b"content-length")
    found: dict[str, str] = {}
    for name, value in scope.get("headers", ()):
        if name in wanted and name.decode() not in found:
            found[name.decode()] = value.decode("latin-1")
    return found


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body in one message, then the client's own
    messages (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
