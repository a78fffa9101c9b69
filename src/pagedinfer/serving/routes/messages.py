"""``POST /v1/messages`` (Anthropic's Messages API): the body checked and translated into a
chat request (:mod:`pagedinfer.serving.anthropic_api.request`), served as chat is, and
answered as a ``message`` or streamed as the API's events. Errors keep OpenAI's JSON shape
(the server's one error format); their statuses are Anthropic's too."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pagedinfer.engine.async_engine import AsyncRequestStream
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.serving.anthropic_api.output import MessageEvents, message_body
from pagedinfer.serving.anthropic_api.request import (
    MessagesRequest,
    chat_request,
    check_message_fields,
)
from pagedinfer.serving.errors import from_exception, log_unexpected
from pagedinfer.serving.failures import raise_if_failed
from pagedinfer.serving.metrics import RequestTimer
from pagedinfer.serving.responses import completions_of, prompt_of
from pagedinfer.serving.state import State
from pagedinfer.serving.streaming import (
    event_stream,
    final_output,
    finish_reason,
    observe,
    until_disconnected,
)
from pagedinfer.serving.translated import submit_chat

__all__ = ["create_message"]


async def create_message(body: MessagesRequest, request: Request, state: State) -> Response:
    check_message_fields(body)
    state.check_model(body.model)
    chat = await submit_chat(chat_request(body), state)
    message_id = f"msg_{uuid.uuid4().hex}"
    model = state.served_model_name
    timer = state.metrics.timer()
    if body.stream:
        prompt_tokens = len(chat.prompt.token_ids)
        events = MessageEvents(message_id, model, prompt_tokens, chat.tools, chat.reasoner)
        return event_stream(_stream(events, chat.stream, timer))
    output = await until_disconnected(request, final_output(chat.stream, timer))
    (completion,) = completions_of(output)
    prompt = prompt_of(output)
    return JSONResponse(
        message_body(message_id, model, prompt, completion, chat.tools, chat.reasoner)
    )


async def _stream(
    events: MessageEvents, stream: AsyncRequestStream, timer: RequestTimer
) -> AsyncIterator[str]:
    final: RequestOutput | None = None
    try:
        for started in events.started():
            yield started
        async for output in stream:
            observe(timer, output)
            if output.finished:
                raise_if_failed(output)
            (completion,) = completions_of(output)
            for item in events.advance(completion):
                yield item
            if output.finished:
                final = output
                timer.finished(finish_reason(output))
    except Exception as error:  # a failed step, a dead engine: the client hears of it
        if final is None:
            timer.finished("error")
        log_unexpected(error, "a streamed message")
        for item in events.failed(from_exception(error).body()["error"]):
            yield item
    except BaseException:  # the client left (or the server stops): nobody to tell
        if final is None:
            timer.finished("abort")
        raise
    finally:
        stream.close()
