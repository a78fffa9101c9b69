"""``POST /v1/chat/completions``: the body checked, rendered and queued by
:func:`~pagedinfer.serving.translated.submit_chat` (as the Responses and Messages APIs'
translated chats are), then answered whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pagedinfer.engine.async_engine import AsyncRequestStream
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.serving.failures import raise_if_failed
from pagedinfer.serving.metrics import RequestTimer
from pagedinfer.serving.protocol import (
    ChatCompletionRequest,
    echo_prefix,
    response_role,
)
from pagedinfer.serving.responses import (
    ChoiceCursor,
    ResponseContext,
    chat_chunk,
    chat_response,
    completions_of,
    prompt_of,
    sse,
    usage_chunk,
)
from pagedinfer.serving.state import State
from pagedinfer.serving.streaming import (
    DONE,
    error_event,
    event_stream,
    final_output,
    finish_reason,
    observe,
    until_disconnected,
)
from pagedinfer.serving.translated import submit_chat

__all__ = ["chat_completions"]


async def chat_completions(body: ChatCompletionRequest, request: Request, state: State) -> Response:
    chat = await submit_chat(body, state)
    stream, params, tools, reasoning = chat.stream, chat.params, chat.tools, chat.reasoning
    ctx = state.context(
        "chatcmpl",
        params,
        body,
        role=response_role(body),
        echo_text=echo_prefix(body),
        prompt_text=bool(body.return_prompt_text),
        tool_calls=tools,
        reasoning=reasoning.parser,
        thinking=reasoning.thinking,
        include_reasoning=body.include_reasoning,
    )
    timer = state.metrics.timer()
    if body.stream:
        return event_stream(_stream(ctx, stream, timer, body.include_usage))
    output = await until_disconnected(request, final_output(stream, timer))
    return JSONResponse(chat_response(ctx, output))


async def _stream(
    ctx: ResponseContext, stream: AsyncRequestStream, timer: RequestTimer, include_usage: bool
) -> AsyncIterator[str]:
    cursors: dict[int, ChoiceCursor] = {}
    final: RequestOutput | None = None
    try:
        async for output in stream:
            observe(timer, output)
            if output.finished:
                raise_if_failed(output)  # an error event for this stream, then [DONE]
            prompt = prompt_of(output)
            for completion in completions_of(output):
                cursor = cursors.setdefault(completion.index, ChoiceCursor())
                chunk = chat_chunk(ctx, completion, cursor, prompt)
                if chunk is not None:
                    yield sse(chunk)
            if output.finished:
                final = output
                timer.finished(finish_reason(output))
        if include_usage and final is not None:
            yield sse(usage_chunk(ctx, "chat.completion.chunk", [final]))
    except Exception as error:  # a failed step, a dead engine: the client hears of it
        if final is None:
            timer.finished("error")
        yield error_event(error, ctx)
    except BaseException:  # the client left (or the server stops): nobody to tell
        if final is None:
            timer.finished("abort")
        raise
    finally:
        stream.close()
    yield DONE
