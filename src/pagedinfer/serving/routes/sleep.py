"""vLLM's sleep-mode endpoints, served with ``--enable-sleep-mode`` only (docs/sleep_mode.md).

``POST /sleep?level=1``, ``POST /wake_up`` (``?tags=weights&tags=kv_cache`` wakes one half),
``GET /is_sleeping``, and ``POST /pause`` / ``POST /resume`` / ``GET /is_paused`` for weight
updates between steps. vLLM serves them in its development mode only
(``VLLM_SERVER_DEV_MODE=1``); here the flag turns them on, and like every route but
``/health`` and ``/version`` they need the API key when the server has one. Refusals are
OpenAI-shaped errors: a bad level or tag 400, ``/sleep`` with requests unfinished 409.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query, Response

from pagedinfer.serving.state import State

__all__ = ["is_paused", "is_sleeping", "pause", "resume", "sleep", "wake_up"]


async def sleep(state: State, level: int = 1) -> Response:
    await state.engine.sleep(level)
    return Response(status_code=200)


async def wake_up(state: State, tags: Annotated[list[str] | None, Query()] = None) -> Response:
    await state.engine.wake_up(tags)
    return Response(status_code=200)


async def is_sleeping(state: State) -> dict[str, Any]:
    return {"is_sleeping": state.engine.is_sleeping()}


async def pause(state: State, timeout: float = 60.0) -> Response:
    await state.engine.pause_generation(timeout)
    return Response(status_code=200)


async def resume(state: State) -> Response:
    await state.engine.resume_generation()
    return Response(status_code=200)


async def is_paused(state: State) -> dict[str, Any]:
    return {"is_paused": state.engine.is_paused()}
