"""``POST /tokenize`` (a prompt or a chat) and ``POST /detokenize``: the tokenizer's work
runs in a worker thread, off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from fastapi import Body
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pagedinfer.serving.prompts import (
    decode_tokens,
    render_chat_ids,
    token_strings,
    tokenize_text,
)
from pagedinfer.serving.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    chat_messages,
)
from pagedinfer.serving.state import State

__all__ = ["detokenize", "tokenize"]

_M = TypeVar("_M", bound=BaseModel)


async def tokenize(
    state: State,
    payload: dict[str, Any] = Body(...),  # noqa: B008
) -> dict[str, Any]:
    body: TokenizeChatRequest | TokenizeCompletionRequest
    if "messages" in payload:
        body = _validated(TokenizeChatRequest, payload)
    else:
        body = _validated(TokenizeCompletionRequest, payload)
    state.admit(body)
    sync_engine = state.engine.engine
    if isinstance(body, TokenizeChatRequest):
        messages = chat_messages(body)
        token_ids = await asyncio.to_thread(
            render_chat_ids, sync_engine, messages, state.rendering(body)
        )
    else:
        token_ids = await asyncio.to_thread(
            tokenize_text,
            sync_engine,
            body.prompt,
            add_special_tokens=body.add_special_tokens,
        )
    strings = None
    if body.return_token_strs:
        strings = await asyncio.to_thread(token_strings, sync_engine, token_ids)
    return {
        "count": len(token_ids),
        "max_model_len": state.engine.max_model_len,
        "tokens": token_ids,
        "token_strs": strings,
    }


async def detokenize(body: DetokenizeRequest, state: State) -> dict[str, Any]:
    state.admit(body)
    return {"prompt": await asyncio.to_thread(decode_tokens, state.engine.engine, body.tokens)}


def _validated(model: type[_M], payload: dict[str, Any]) -> _M:
    """``payload`` parsed as ``model``; its errors answered as FastAPI's own (a 400)."""
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from None
