"""The OpenAI-compatible FastAPI app around one :class:`~pagedinfer.AsyncEngine`.

Routes: ``GET /health``, ``GET /metrics``, ``GET /version``, ``GET /v1/models`` (and
``/v1/models/{id}``), ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST
/v1/responses`` (and ``GET /v1/responses/{id}``), ``POST /v1/messages`` (Anthropic's),
``POST /invocations`` (SageMaker's), ``POST /tokenize``, ``POST /detokenize``; a pooling
model's ``POST /v1/embeddings``, ``/score`` and ``/rerank`` (docs/pooling.md); with
``allow_runtime_lora_updating`` ``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``;
behind a :class:`~pagedinfer.serving.guard.RequestGuard` (Host check, API key, bounded
body). A request is validated and queued before the response starts, so bad input gets a
4xx (OpenAI's error JSON) and never a half-sent stream; the checks run cheapest first: the
fields the server does not serve
(:mod:`pagedinfer.serving.fields`), sizes against the engine's limits, then the sampling
parameters, then the prompt is tokenized (or the chat template rendered) and truncated in
a worker thread, off the event loop and without the engine's lock. A client that
disconnects gets its requests aborted (their KV blocks freed) at once: streamed responses by
Starlette's disconnect listener, the others by
:func:`~pagedinfer.serving.streaming.until_disconnected`.

A request whose step failed gets a 500 (a stream: an error event, then ``[DONE]``); when
the engine is dead every request gets a 503 and ``/health`` too. Neither body says more
than that: the engine logs the traceback.

Each route is a module-level handler in :mod:`pagedinfer.serving.routes` (``info``,
``tokens``, ``completions``, ``chat``) that takes what it uses, the app's
:class:`~pagedinfer.serving.state.ServingState`, as a FastAPI dependency; ``build_app``
builds that state and maps the paths to the routes, and installs the error handlers and the
guard.
"""

from __future__ import annotations

from fastapi import FastAPI

from pagedinfer.engine.async_engine import AsyncEngine
from pagedinfer.errors import ConfigurationError, InvalidRequestError
from pagedinfer.serving.errors import install_error_handlers
from pagedinfer.serving.guard import RequestGuard
from pagedinfer.serving.options import ServingOptions
from pagedinfer.serving.routes import (
    chat,
    completions,
    info,
    invocations,
    lora_admin,
    messages,
    pooling,
    responses,
    sleep,
    tokens,
)
from pagedinfer.serving.state import ServingState

__all__ = ["build_app"]


def build_app(
    engine: AsyncEngine, *, served_model_name: str, options: ServingOptions | None = None
) -> FastAPI:
    """The app serving ``engine`` under the model name ``served_model_name``, admitting
    requests by ``options`` (default: no key, any Host, 1 MiB bodies).

    The app does not own the engine: whoever built it closes it (``pagedinfer serve`` does,
    after the server stops).
    """
    options = options or ServingOptions()
    app = FastAPI(title="pagedinfer", docs_url=None, redoc_url=None, openapi_url=None)
    state = ServingState.build(engine, served_model_name, options)
    app.state.serving = state  # what the routes read (serving.state.State)
    app.state.engine = engine
    app.state.metrics = state.metrics
    install_error_handlers(app, on_error=state.rejected, redact=state.redactor())
    app.add_middleware(RequestGuard, options=options, on_reject=state.rejected)
    # The paths, registered on the app itself: an included APIRouter adds a routing layer
    # that costs every request measurably more CPU.
    app.get("/health")(info.health)
    app.get("/metrics")(info.prometheus)
    app.get("/version")(info.version)
    app.get("/v1/models")(info.models)
    app.get("/v1/models/{model_id:path}")(info.model)
    if options.enable_sleep_mode:  # vLLM's development endpoints (docs/sleep_mode.md)
        app.post("/sleep")(sleep.sleep)
        app.post("/wake_up")(sleep.wake_up)
        app.get("/is_sleeping")(sleep.is_sleeping)
        app.post("/pause")(sleep.pause)
        app.post("/resume")(sleep.resume)
        app.get("/is_paused")(sleep.is_paused)
    app.post("/tokenize")(tokens.tokenize)
    app.post("/detokenize")(tokens.detokenize)
    app.post("/v1/completions", response_model=None)(completions.completions)
    app.post("/v1/chat/completions", response_model=None)(chat.chat_completions)
    app.post("/v1/responses", response_model=None)(responses.create_response)
    app.get("/v1/responses/{response_id}", response_model=None)(responses.retrieve_response)
    app.post("/invocations", response_model=None)(invocations.invocations)
    app.post("/v1/messages", response_model=None)(messages.create_message)
    app.post("/v1/embeddings")(pooling.embeddings)  # a pooling model's (--runner pooling)
    for path in ("/score", "/v1/score"):
        app.post(path)(pooling.score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(pooling.rerank)
    serve_lora_modules(state, options.lora_modules)
    if options.allow_runtime_lora_updating:
        app.post("/v1/load_lora_adapter", response_model=None)(lora_admin.load_adapter)
        app.post("/v1/unload_lora_adapter", response_model=None)(lora_admin.unload_adapter)
    return app


def serve_lora_modules(state: ServingState, modules: tuple[tuple[str, str], ...]) -> None:
    """Check and serve the ``--lora-modules`` adapters (``ConfigurationError`` naming the
    first that cannot be served)."""
    for name, path in modules:
        if name == state.served_model_name or state.loras.get(name) is not None:
            raise ConfigurationError(f"--lora-modules: the model name {name!r} is taken.")
        lora = state.loras.new(name, path)
        try:
            state.engine.engine.add_lora(lora)
        except InvalidRequestError as error:
            raise ConfigurationError(f"--lora-modules {name}={path}: {error}") from None
        state.loras.publish(lora)
