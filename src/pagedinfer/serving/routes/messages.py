"""``POST /v1/messages`` (Anthropic's Messages API): the body checked and translated into a
chat request (:mod:`pagedinfer.serving.anthropic_api.request`), served as chat is, and
answered as a ``message`` or streamed as the API's events. Errors keep OpenAI's JSON shape
(the server's one error format); their statuses are Anthropic's too."""

from __future__ import annotations

import asyncio
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
from pagedinfer.serving.prompts import encode_chat
from pagedinfer.serving.protocol import chat_messages, chat_sampling_params, check_sizes
from pagedinfer.serving.responses import completions_of, prompt_of
from pagedinfer.serving.responses_api.output import Reasoner
from pagedinfer.serving.state import State
from pagedinfer.serving.streaming import (
    event_stream,
    final_output,
    finish_reason,
    observe,
    until_disconnected,
)
from pagedinfer.serving.structured import structured_request
from pagedinfer.serving.tools import plan_tools

__all__ = ["create_message"]


async def create_message(body: MessagesRequest, request: Request, state: State) -> Response:
    check_message_fields(body)
    state.check_model(body.model)
    chat = chat_request(body)
    state.admit(chat)
    engine, options = state.engine, state.options
    check_sizes(chat, state.limits, state.vocab_size)
    tools = plan_tools(
        chat.tools,
        chat.tool_choice,
        chat.parallel_tool_calls,
        parser=options.tool_call_parser,
        auto_tool_choice=options.enable_auto_tool_choice,
        end_texts=state.end_texts,
    )
    structured = structured_request(chat, tools.constraint)
    params = chat_sampling_params(
        chat,
        None if structured is None else structured.params,
        keep_special_tokens=tools.keeps_special_tokens,
    )
    params = await state.checked(params, structured)
    prompt = await asyncio.to_thread(
        encode_chat, engine.engine, chat_messages(chat), state.rendering(chat)
    )
    stream = state.submit(prompt, params, structured)
    message_id = f"msg_{uuid.uuid4().hex}"
    reasoner: Reasoner | None = None  # the server's reasoning parser: none yet
    timer = state.metrics.timer()
    if body.stream:
        events = MessageEvents(
            message_id, state.served_model_name, len(prompt.token_ids), tools.calls, reasoner
        )
        return event_stream(_stream(events, stream, timer))
    output = await until_disconnected(request, final_output(stream, timer))
    (completion,) = completions_of(output)
    return JSONResponse(
        message_body(
            message_id,
            state.served_model_name,
            prompt_of(output),
            completion,
            tools.calls,
            reasoner,
        )
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
