"""The OpenAI-compatible HTTP server (``pagedinfer serve``; ``pip install '.[serve]'``).

``build_app(async_engine, served_model_name=..., options=...)`` is the FastAPI app
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``);
``run_server(model_dir, host=..., port=..., engine_kwargs=..., options=...)`` binds the port,
builds the engine and serves it with uvicorn. ``ServingOptions`` holds the admission rules
(API key, allowed hosts, body size, timeouts). See docs/serving.md. Serving sits beside the
command line on top of the engine: it imports ``pagedinfer.engine`` and below, never the
reverse.

Importing this package loads neither FastAPI nor torch; its names load on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedinfer.serving.app import build_app
    from pagedinfer.serving.options import ServingOptions
    from pagedinfer.serving.server import run_server

__all__ = ["ServingOptions", "build_app", "run_server"]

_LAZY = {
    "ServingOptions": "pagedinfer.serving.options",
    "build_app": "pagedinfer.serving.app",
    "run_server": "pagedinfer.serving.server",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'pagedinfer.serving' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
