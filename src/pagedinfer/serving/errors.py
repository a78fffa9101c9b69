"""OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}`` with its status.

400 for input the server cannot serve (malformed JSON, a bad or unsupported parameter, a
prompt too long), 404 for an unknown model or route, 503 when the engine has died. The
message is the library's own (it says what was wrong and what is allowed).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagedinfer.errors import EngineClosedError, EngineDeadError
from pagedinfer.serving.protocol import RequestFieldError

__all__ = ["OpenAIError", "error_body", "install_error_handlers"]

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
    """The response for an exception raised while serving a request."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, RequestFieldError):
        return OpenAIError(400, str(error), param=error.param)
    if isinstance(error, (EngineDeadError, EngineClosedError)):
        return OpenAIError(503, str(error), type="server_error", code="engine_unavailable")
    if isinstance(error, ValueError):  # InvalidRequestError, InvalidSamplingParamsError
        match = _FIELD.search(str(error))
        return OpenAIError(400, str(error), param=match.group(1) if match else None)
    return OpenAIError(500, f"internal error: {error!r}", type="server_error")


def install_error_handlers(app: FastAPI, on_error: Any = None) -> None:
    """Every error the app answers comes out in OpenAI's shape."""

    async def openai_error(request: Request, error: Exception) -> JSONResponse:
        converted = from_exception(error)
        if on_error is not None:
            on_error(converted.status)
        return JSONResponse(converted.body(), status_code=converted.status)

    async def validation_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        problems = error.errors()
        param = None
        parts = []
        if any(problem.get("type") == "json_invalid" for problem in problems):
            message = problems[0].get("ctx", {}).get("error", "not valid JSON")
            if on_error is not None:
                on_error(400)
            body = error_body(
                f"the request body is not valid JSON: {message}.", "invalid_request_error"
            )
            return JSONResponse(body, status_code=400)
        for problem in problems[:3]:
            location = [str(item) for item in problem.get("loc", ()) if item != "body"]
            if param is None and location:
                param = location[0]
            where = ".".join(location) or "body"
            parts.append(f"{where}: {problem.get('msg', 'invalid')}")
        converted = OpenAIError(400, "invalid request: " + "; ".join(parts) + ".", param=param)
        if on_error is not None:
            on_error(400)
        return JSONResponse(converted.body(), status_code=400)

    async def http_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, HTTPException)
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        body = error_body(str(error.detail), kind)
        if on_error is not None:
            on_error(error.status_code)
        return JSONResponse(body, status_code=error.status_code)

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(ValueError, openai_error)
    app.add_exception_handler(EngineDeadError, openai_error)
    app.add_exception_handler(EngineClosedError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
