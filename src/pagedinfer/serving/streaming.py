"""Reading a request's outputs for a response: to the end (:func:`final_output`, cancelled
when the client leaves: :func:`until_disconnected`) or as server-sent events
(:func:`event_stream`, ended by :data:`DONE`, or by :func:`error_event` when it fails), and
telling the request's timer (:mod:`pagedinfer.serving.metrics`) what arrived."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedinfer.engine.async_engine import AsyncRequestStream
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.serving.errors import OpenAIError, from_exception, log_unexpected
from pagedinfer.serving.failures import raise_if_failed
from pagedinfer.serving.metrics import RequestTimer
from pagedinfer.serving.responses import ResponseContext, completions_of, prompt_of, sse

__all__ = [
    "DONE",
    "error_event",
    "event_stream",
    "final_output",
    "finish_reason",
    "observe",
    "until_disconnected",
]

DONE = "data: [DONE]\n\n"
"""The event that ends every stream."""

_T = TypeVar("_T")


async def final_output(stream: AsyncRequestStream, timer: RequestTimer) -> RequestOutput:
    """Read a stream to its final output, timing its tokens."""
    output: RequestOutput | None = None
    try:
        async for output in stream:
            observe(timer, output)
    except asyncio.CancelledError:
        timer.finished("abort")
        raise
    except Exception:
        timer.finished("error")
        raise
    assert output is not None and output.finished
    timer.finished(finish_reason(output))
    raise_if_failed(output)  # its own input failed it: an error response for it alone
    return output


async def until_disconnected(request: Request, work: Awaitable[_T]) -> _T:
    """Await ``work``; if the client disconnects first, cancel it (which aborts its
    requests) and answer 499 to nobody."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise OpenAIError(499, "the client closed the connection")
    return task.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def error_event(error: Exception, ctx: ResponseContext) -> str:
    """The event that ends a stream that failed: OpenAI's error JSON (generic for a 5xx; the
    failure is logged, by the engine or here)."""
    log_unexpected(error, f"the stream {ctx.response_id}")
    return sse(from_exception(error).body())


def observe(timer: RequestTimer, output: RequestOutput) -> None:
    """Tell a request's timer what has arrived: its tokens so far (the longest completion's),
    and its prompt (counted with the first token)."""
    prompt = prompt_of(output)
    num_tokens = max((len(c.token_ids) for c in completions_of(output)), default=0)
    timer.tokens(num_tokens, len(prompt.token_ids), prompt.num_cached_tokens)


def finish_reason(output: RequestOutput) -> str | None:
    """The request's finish reason for the metrics: ``abort`` if a completion was aborted."""
    reasons = {c.finish_reason for c in completions_of(output)}
    return "abort" if "abort" in reasons else next(iter(sorted(r for r in reasons if r)), None)
