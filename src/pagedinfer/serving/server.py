"""``pagedinfer serve``: bind the port, build the engine, serve the app with uvicorn, close.

Start-up checks come before the model loads: the listening socket is bound first, so a
busy port or a bad address fails in a second, not after the weights are read. The socket
then goes to uvicorn as is.

If the engine dies while serving (:meth:`AsyncEngine.on_dead`), the server shuts down and
:func:`run_server` raises :class:`~pagedinfer.errors.EngineDeadError`: the command line
exits with ``EXIT_ENGINE_DEAD`` so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import errno
import logging
import logging.config
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from pagedinfer.engine.async_engine import AsyncEngine
from pagedinfer.errors import ConfigurationError, EngineDeadError
from pagedinfer.serving.app import build_app
from pagedinfer.serving.generation_defaults import request_defaults
from pagedinfer.serving.options import (
    AddressInUseError,
    ServingOptions,
    default_allowed_hosts,
    served_name,
)
from pagedinfer.serving.transport import protocol_class

__all__ = ["bind_socket", "run_server", "serve_engine"]

# Seconds in-flight responses get to finish after SIGINT / SIGTERM before they are cut off.
# They finish at once in practice: shutting down aborts their requests first.
GRACEFUL_SHUTDOWN_SECONDS = 5
# Connections the kernel queues while the model loads or the server is busy.
BACKLOG = 2048

logger = logging.getLogger("pagedinfer.serving")


class _Server(uvicorn.Server):
    """uvicorn's server, which aborts the engine's requests as soon as shutdown starts, and
    shuts down when the engine dies.

    Otherwise a stream with many tokens to go would hold the shutdown for the whole grace
    period; this way each in-flight response ends with ``finish_reason="abort"`` at once.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine) -> None:
        super().__init__(config)
        self._engine = engine
        self.engine_error: BaseException | None = None

    def engine_died(self, error: BaseException) -> None:
        """``AsyncEngine.on_dead`` callback (the step thread): stop serving."""
        self.engine_error = error
        self.should_exit = True  # uvicorn's main loop checks it every 0.1 s

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for sock in sockets or ():
            host, port = sock.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            logger.info("serving on http://%s:%d (Ctrl-C to quit)", shown, port)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await asyncio.to_thread(self._engine.close)
        await super().shutdown(sockets)


class _Stop(Exception):
    """SIGTERM, turned into an exception so that the engine is closed on the way out."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (uvicorn's address rules: IPv6 if
    ``host`` has a colon).

    Raises :class:`AddressInUseError` if another process holds the port,
    :class:`~pagedinfer.errors.ConfigurationError` for an address this machine cannot bind
    (a host name that does not resolve, an address it does not have, a privileged port).
    """
    if not 0 <= port <= 65535:
        raise ConfigurationError(f"port {port} is out of range: expected 0 to 65535.")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn: a restarted server may bind while old connections are in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        # Listening now reserves the port (two servers starting together cannot both get
        # it); connections made while the model loads wait in the backlog.
        sock.listen(BACKLOG)
    except OSError as error:
        sock.close()
        where = f"{host}:{port}"
        if error.errno == errno.EADDRINUSE:
            in_use = AddressInUseError(
                f"cannot listen on {where}: the address is already in use (another server "
                "runs there?): stop it or choose another --port"
            )
            in_use.errno = errno.EADDRINUSE
            raise in_use from None
        raise ConfigurationError(
            f"cannot listen on {where}: {error.strerror or error}: choose another --host / --port"
        ) from None
    return sock


def run_server(
    model_path: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "info",
    engine_kwargs: dict[str, Any] | None = None,
    options: ServingOptions | None = None,
) -> None:
    """Serve ``model_path`` until SIGINT or SIGTERM (blocking), then return.

    The port is bound before the model loads (a busy port fails at once:
    :class:`AddressInUseError`); the server answers once the model is ready.
    ``served_model_name`` defaults to the checkpoint directory's name. ``options`` defaults
    to :class:`ServingOptions` with the Host check of :func:`default_allowed_hosts`.
    Raises :class:`~pagedinfer.errors.EngineDeadError` if the engine died while serving
    (the server shut down at once).
    """
    options = options or ServingOptions()
    loopback = default_allowed_hosts(host)
    if options.allowed_hosts is None and loopback is not None:
        options = dataclasses.replace(options, allowed_hosts=loopback)
    _configure_logging(log_level)
    sock = bind_socket(host, port)
    if loopback is None and options.api_key is None:
        logger.warning(
            "serving on %s without an API key: anyone who can connect may use it "
            "(set PAGEDINFER_API_KEY or --api-key; docs/serving.md, Deploying)",
            host,
        )
    try:
        logger.info("listening on %s:%d; loading %s ...", host, sock.getsockname()[1], model_path)
        engine = AsyncEngine(model_path, **(engine_kwargs or {}))
        name = served_model_name or served_name(os.fspath(model_path))
        logger.info("%s; served as %r", engine.engine.describe(), name)
        if defaults := request_defaults(engine.engine.config):
            logger.info(
                "default sampling fields from the model's generation config: %s (a request "
                "that sets a field keeps its own; --generation-config vllm ignores the file)",
                ", ".join(f"{key}={value!r}" for key, value in defaults.items()),
            )
        serve_engine(engine, sock, served_model_name=name, log_level=log_level, options=options)
    finally:
        sock.close()


def serve_engine(
    engine: AsyncEngine,
    sock: socket.socket,
    *,
    served_model_name: str,
    log_level: str = "info",
    options: ServingOptions | None = None,
) -> None:
    """Serve ``engine`` on the bound socket ``sock`` until SIGINT / SIGTERM or the engine
    dies; close the engine either way. Raises ``EngineDeadError`` in the latter case."""
    options = options or ServingOptions()
    try:
        app = build_app(engine, served_model_name=served_model_name, options=options)
        config = uvicorn.Config(
            app,
            log_level=log_level,
            log_config=None,  # run_server configured it; a caller of this function has its own
            http=protocol_class(options.header_timeout_s, options.max_header_bytes),
            lifespan="off",
            backlog=BACKLOG,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        )
        server = _Server(config, engine)
        engine.on_dead(server.engine_died)
        # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again:
        # KeyboardInterrupt, or (SIGTERM) _Stop from the handler installed here.
        with _sigterm_raises_stop(), contextlib.suppress(KeyboardInterrupt, _Stop):
            server.run(sockets=[sock])
    finally:
        engine.close()
    if server.engine_error is not None:
        raise EngineDeadError(
            "the engine failed while serving (the log above has its traceback); the server "
            "shut down so that it can be restarted"
        ) from server.engine_error


def _logging_config(log_level: str) -> dict[str, Any]:
    """uvicorn's logging configuration, with pagedinfer's loggers (failed steps, unexpected
    errors: with tracebacks) on the same stream."""
    config = copy.deepcopy(LOGGING_CONFIG)
    level = log_level.upper()
    config["loggers"]["pagedinfer"] = {
        "handlers": ["default"],
        "level": "DEBUG" if level == "TRACE" else level,
        "propagate": False,
    }
    return config


def _configure_logging(log_level: str) -> None:
    with contextlib.suppress(ValueError, TypeError):
        logging.config.dictConfig(_logging_config(log_level))


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
