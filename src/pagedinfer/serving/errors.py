"""OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}`` with its status.

400 for input the server cannot serve (malformed JSON, a bad or unsupported parameter, a
prompt too long), 401 without the API key, 404 for an unknown model or route, 413 for a body
over ``--max-request-bytes``, 408 for a body that does not arrive in time, 500 when a step
that held the request failed, 503 when the engine is dead or shutting down.

A 4xx message is the library's own (it says what was wrong and what is allowed). A 5xx
message is generic: what failed inside the server (exception text, paths) goes to the log,
never to the client.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagedinfer.errors import (
    EngineClosedError,
    EngineDeadError,
    EngineSleepingError,
    EngineStateError,
    PagedInferError,
    StepFailedError,
)
from pagedinfer.serving.protocol import RequestFieldError

__all__ = [
    "ENGINE_DEAD_MESSAGE",
    "INTERNAL_ERROR_MESSAGE",
    "SHUTTING_DOWN_MESSAGE",
    "STEP_FAILED_MESSAGE",
    "OpenAIError",
    "error_body",
    "from_exception",
    "install_error_handlers",
]

logger = logging.getLogger("pagedinfer.serving")

STEP_FAILED_MESSAGE = (
    "The server had an error while generating this response (the failure is logged on the "
    "server). Other requests are not affected: retry it."
)
ENGINE_DEAD_MESSAGE = "The engine failed and the server is restarting: retry later."
SHUTTING_DOWN_MESSAGE = "The server is shutting down: retry later."
INTERNAL_ERROR_MESSAGE = (
    "The server had an error while processing this request (the failure is logged on the server)."
)

# "SamplingParams.top_p=2.0 is invalid: ..." (or "SamplingParams.logprobs=... exceeds") names the
# field; OpenAI's param is the same name.
_FIELD = re.compile(r"SamplingParams\.(\w+)")


class OpenAIError(Exception):
    """An error response: raise it from a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str,
    type: str,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_exception(error: BaseException) -> OpenAIError:
    """The response for an exception raised while serving a request.

    Only the library's input errors (``InvalidRequestError``, ``InvalidSamplingParamsError``:
    a ``PagedInferError`` that is a ``ValueError``) keep their message; anything else is a
    5xx with a generic one.
    """
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, RequestFieldError):
        return OpenAIError(400, str(error), param=error.param)
    if isinstance(error, StepFailedError):
        return OpenAIError(500, STEP_FAILED_MESSAGE, type="server_error")
    if isinstance(error, EngineDeadError):
        return OpenAIError(503, ENGINE_DEAD_MESSAGE, type="server_error", code="engine_unavailable")
    if isinstance(error, EngineClosedError):
        return OpenAIError(
            503, SHUTTING_DOWN_MESSAGE, type="server_error", code="engine_unavailable"
        )
    if isinstance(error, EngineSleepingError):
        return OpenAIError(503, str(error), type="server_error", code="engine_sleeping")
    if isinstance(error, EngineStateError):
        return OpenAIError(409, str(error), type="invalid_request_error", code="engine_busy")
    if isinstance(error, PagedInferError) and isinstance(error, ValueError):
        match = _FIELD.search(str(error))
        return OpenAIError(400, str(error), param=match.group(1) if match else None)
    return OpenAIError(500, INTERNAL_ERROR_MESSAGE, type="server_error")


def is_expected(error: BaseException) -> bool:
    """Whether an error needs no log entry of its own: a client's mistake, or a failure the
    engine logged already (a failed step, a dead or closed engine)."""
    return from_exception(error).status < 500 or isinstance(
        error, (StepFailedError, EngineDeadError, EngineClosedError, EngineSleepingError)
    )


def log_unexpected(error: BaseException, where: str) -> None:
    """Log an error that becomes a generic 5xx, with its traceback (unless it is expected)."""
    if not is_expected(error):
        logger.error("unexpected error while serving %s", where, exc_info=error)


def install_error_handlers(
    app: FastAPI,
    on_error: Callable[[int], None] | None = None,
    redact: Callable[[str], str] | None = None,
) -> None:
    """Every error the app answers comes out in OpenAI's shape.

    ``on_error(status)`` counts each; ``redact(message)`` cleans a 4xx message of what a
    client need not see (the checkpoint's path).
    """

    def respond(converted: OpenAIError) -> JSONResponse:
        if on_error is not None:
            on_error(converted.status)
        if redact is not None and converted.status < 500:
            converted.message = redact(converted.message)
        return JSONResponse(converted.body(), status_code=converted.status)

    async def openai_error(request: Request, error: Exception) -> JSONResponse:
        log_unexpected(error, f"{request.method} {request.url.path}")
        return respond(from_exception(error))

    async def validation_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        problems = error.errors()
        if any(problem.get("type") == "json_invalid" for problem in problems):
            message = problems[0].get("ctx", {}).get("error", "not valid JSON")
            return respond(OpenAIError(400, f"the request body is not valid JSON: {message}."))
        param = None
        parts = []
        for problem in problems[:3]:
            location = [str(item) for item in problem.get("loc", ()) if item != "body"]
            if param is None and location:
                param = location[0]
            where = ".".join(location) or "body"
            # pydantic's error type too ("less_than_equal"): vLLM's messages carry it.
            kind = f" [type={problem['type']}]" if problem.get("type") else ""
            parts.append(f"{where}: {problem.get('msg', 'invalid')}{kind}")
        return respond(OpenAIError(400, "invalid request: " + "; ".join(parts) + ".", param=param))

    async def http_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, HTTPException)
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return respond(OpenAIError(error.status_code, str(error.detail), type=kind))

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(PagedInferError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
