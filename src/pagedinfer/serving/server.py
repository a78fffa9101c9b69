"""``pagedinfer serve``: build the engine, serve the app with uvicorn, close the engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from pagedinfer.engine.async_engine import AsyncEngine
from pagedinfer.serving.app import build_app

__all__ = ["run_server"]

# Seconds in-flight responses get to finish after SIGINT / SIGTERM before they are cut off.
# They finish at once in practice: shutting down aborts their requests first.
GRACEFUL_SHUTDOWN_SECONDS = 5


class _Server(uvicorn.Server):
    """uvicorn's server, which aborts the engine's requests as soon as shutdown starts.

    Otherwise a stream with many tokens to go would hold the shutdown for the whole grace
    period; this way each in-flight response ends with ``finish_reason="abort"`` at once.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine) -> None:
        super().__init__(config)
        self._engine = engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await asyncio.to_thread(self._engine.close)
        await super().shutdown(sockets)


class _Stop(Exception):
    """SIGTERM, turned into an exception so that the engine is closed on the way out."""


def run_server(
    model_path: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "info",
    engine_kwargs: dict[str, Any] | None = None,
) -> None:
    """Serve ``model_path`` until SIGINT or SIGTERM (blocking), then return.

    The model is loaded before the port opens, so a server that accepts connections is
    ready; ``served_model_name`` defaults to ``model_path`` as given (vLLM's rule).
    """
    engine = AsyncEngine(model_path, **(engine_kwargs or {}))
    try:
        app = build_app(engine, served_model_name=served_model_name or os.fspath(model_path))
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        )
        # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again:
        # KeyboardInterrupt, or (SIGTERM) _Stop from the handler installed here.
        with _sigterm_raises_stop(), contextlib.suppress(KeyboardInterrupt, _Stop):
            _Server(config, engine).run()
    finally:
        engine.close()


@contextlib.contextmanager
def _sigterm_raises_stop() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise _Stop

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
