"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's bodies and
answers), served with ``--allow-runtime-lora-updating`` and behind the API key.

Loading checks the adapter against the model (its config and tensor shapes: a bad adapter is
a 400 and nothing changes) and serves it under ``lora_name`` (a name in use is a 400).
Unloading an adapter that unfinished requests use is refused with a 409 (the client retries
once they finish, or aborts them); an unknown name is a 404.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagedinfer.engine.lora import LoRAAdapterInUseError
from pagedinfer.serving.errors import OpenAIError
from pagedinfer.serving.state import State

__all__ = ["LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest", "load_adapter", "unload_adapter"]


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


async def load_adapter(body: LoadLoRAAdapterRequest, state: State) -> PlainTextResponse:
    loras = state.loras
    if body.lora_name == state.served_model_name or loras.get(body.lora_name) is not None:
        raise OpenAIError(
            400,
            f"The lora adapter '{body.lora_name}' has already been loaded (unload it first, "
            "or choose another name).",
            param="lora_name",
            code="lora_adapter_exists",
        )
    lora = loras.new(body.lora_name, body.lora_path)
    # Reads the adapter's config and header: a worker thread, off the event loop.
    await asyncio.to_thread(state.engine.engine.add_lora, lora)
    loras.publish(lora)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_adapter(body: UnloadLoRAAdapterRequest, state: State) -> PlainTextResponse:
    lora = state.loras.get(body.lora_name)
    if lora is None or (body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id):
        raise OpenAIError(
            404,
            f"The lora adapter '{body.lora_name}' cannot be found.",
            param="lora_name",
            code="lora_adapter_not_found",
        )
    try:
        state.engine.engine.remove_lora(lora.lora_int_id)
    except LoRAAdapterInUseError as error:
        raise OpenAIError(409, str(error), param="lora_name", code="lora_adapter_in_use") from None
    state.loras.withdraw(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
