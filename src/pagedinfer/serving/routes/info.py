"""``GET /health``, ``/metrics``, ``/version``, ``/v1/models`` and ``/v1/models/{id}``."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse

from pagedinfer.serving.errors import ENGINE_DEAD_MESSAGE, SHUTTING_DOWN_MESSAGE, error_body
from pagedinfer.serving.metrics import CONTENT_TYPE
from pagedinfer.serving.state import ServingState, State

__all__ = ["health", "model", "model_card", "models", "prometheus", "version"]


async def health(state: State) -> Response:
    engine = state.engine
    if not engine.is_running:
        message = ENGINE_DEAD_MESSAGE if engine.is_dead else SHUTTING_DOWN_MESSAGE
        return JSONResponse(
            error_body(message, "server_error", code="engine_unavailable"), status_code=503
        )
    return Response(status_code=200)


async def prometheus(state: State) -> Response:
    engine = state.engine
    stats = await engine.stats() if engine.is_running else None
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)


async def version() -> dict[str, str]:
    from pagedinfer import __version__

    return {"version": __version__}


async def models(state: State) -> dict[str, Any]:
    adapters = [model_card(state, lora.lora_name) for lora in state.loras.all()]
    return {"object": "list", "data": [model_card(state), *adapters]}


async def model(model_id: str, state: State) -> dict[str, Any]:
    state.check_model(model_id)
    return model_card(state, model_id)


def model_card(state: ServingState, model_id: str | None = None) -> dict[str, Any]:
    """The served model (or its LoRA adapter ``model_id``, whose ``parent`` is the base
    model's name and ``root`` its path, as vLLM's) as OpenAI's ``/v1/models`` lists it."""
    name, created = state.served_model_name, state.created
    lora = state.loras.get(model_id)
    return {
        "id": name if lora is None else lora.lora_name,
        "object": "model",
        "created": created,
        "owned_by": "pagedinfer",
        "root": name if lora is None else lora.lora_path,
        "parent": None if lora is None else name,
        "max_model_len": state.engine.max_model_len,
        "permission": [
            {
                "id": f"modelperm-{uuid.uuid4().hex}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
