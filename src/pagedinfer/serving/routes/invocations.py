"""``POST /invocations``: Amazon SageMaker's one route, dispatched by the body's shape as vLLM
does: a body with ``messages`` is a chat completion, one with ``prompt`` a completion (each
answered exactly as its own route answers it, streamed or not). Anything else is a 400 that
says what the route serves."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from pagedinfer.serving.errors import OpenAIError
from pagedinfer.serving.protocol import ChatCompletionRequest, CompletionRequest
from pagedinfer.serving.routes import chat, completions
from pagedinfer.serving.state import State

__all__ = ["invocations"]

_SERVED = (
    "expected a chat completion body (with messages) or a completion body (with prompt); "
    "this server has no embedding, scoring or pooling routes"
)


async def invocations(request: Request, state: State) -> Response:
    try:
        body: Any = json.loads(await request.body())
    except ValueError as error:
        raise OpenAIError(400, f"the request body is not valid JSON: {error}.") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the request body must be a JSON object: {_SERVED}.")
    try:
        if "messages" in body:
            chat_body = ChatCompletionRequest.model_validate(body)
            return await chat.chat_completions(chat_body, request, state)
        if "prompt" in body:
            completion_body = CompletionRequest.model_validate(body)
            return await completions.completions(completion_body, request, state)
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from None
    raise OpenAIError(400, f"Cannot find a suitable handler for this request: {_SERVED}.")
