"""The app's routes, one module per concern, each a module-level handler that takes the
app's :class:`~pagedinfer.serving.state.ServingState` as a dependency; ``build_app``
includes :data:`ROUTERS` in this order."""

from __future__ import annotations

from fastapi import APIRouter

from pagedinfer.serving.routes import chat, completions, info, tokens

__all__ = ["ROUTERS"]

ROUTERS: tuple[APIRouter, ...] = (info.router, tokens.router, completions.router, chat.router)
