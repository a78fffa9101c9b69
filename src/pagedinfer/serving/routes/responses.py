"""``POST /v1/responses`` (OpenAI's Responses API) and ``GET /v1/responses/{id}``.

The body is checked (its fields, its model, ``previous_response_id``), translated into a
chat request (:mod:`pagedinfer.serving.responses_api.request`) and served as chat is
(:func:`~pagedinfer.serving.translated.submit_chat`).
The answer comes back whole as a ``response`` object or streamed as the API's events, and
is kept in the app's :class:`~pagedinfer.serving.responses_api.store.ResponseStore` when
the request has ``store: true``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.serving.errors import OpenAIError, from_exception, log_unexpected
from pagedinfer.serving.failures import raise_if_failed
from pagedinfer.serving.fields import RequestFieldError
from pagedinfer.serving.metrics import RequestTimer
from pagedinfer.serving.responses import completions_of, prompt_of
from pagedinfer.serving.responses_api.events import ResponseEvents
from pagedinfer.serving.responses_api.output import (
    ResponseShape,
    assistant_message,
    response_body,
)
from pagedinfer.serving.responses_api.request import (
    ResponsesRequest,
    chat_request,
    check_response_fields,
    input_messages,
)
from pagedinfer.serving.state import ServingState, State
from pagedinfer.serving.streaming import (
    event_stream,
    final_output,
    finish_reason,
    observe,
    until_disconnected,
)
from pagedinfer.serving.translated import SubmittedChat, submit_chat

__all__ = ["create_response", "retrieve_response"]

# Stores a finished response's body (with the conversation it was answered from).
_Keep = Callable[[dict[str, Any]], None]


async def create_response(body: ResponsesRequest, request: Request, state: State) -> Response:
    check_response_fields(body, state.policy)
    state.check_model(body.model)
    history = _history(state, body.previous_response_id)
    chat = await submit_chat(chat_request(body, history), state)
    shape = ResponseShape(
        response_id=f"resp_{body.request_id or uuid.uuid4().hex}",
        model=state.served_model_name,
        request=body,
    )
    keep = _keeper(state, body, [*history, *input_messages(body.input)])
    timer = state.metrics.timer()
    if body.stream:
        events = ResponseEvents(shape, chat.tools, chat.reasoner)
        return event_stream(_stream(events, chat, timer, keep))
    output = await until_disconnected(request, final_output(chat.stream, timer))
    (completion,) = completions_of(output)
    response = response_body(
        shape,
        prompt_of(output),
        completion,
        chat.tools,
        chat.reasoner,
        chat.reasoning_tokens(completion.token_ids),
    )
    keep(response)
    return JSONResponse(response)


async def retrieve_response(response_id: str, state: State) -> Response:
    stored = state.responses.get(response_id)
    if stored is None:
        raise OpenAIError(
            404,
            f"Response with id {response_id!r} not found: it was not stored (store=false), "
            "or this server has forgotten it (it keeps the most recent ones, in memory).",
            type="not_found_error",
        )
    return JSONResponse(dict(stored.body))


def _history(state: ServingState, previous_response_id: str | None) -> list[dict[str, Any]]:
    if previous_response_id is None:
        return []
    stored = state.responses.get(previous_response_id)
    if stored is None:
        raise RequestFieldError(
            "previous_response_id",
            f"Previous response with id {previous_response_id!r} not found: it was not "
            "stored (store=false), or this server has forgotten it (it keeps the most recent "
            "ones, in memory). Send the conversation as input instead.",
        )
    return [dict(message) for message in stored.conversation]


def _keeper(
    state: ServingState, body: ResponsesRequest, conversation: Sequence[Mapping[str, Any]]
) -> _Keep:
    def keep(response: dict[str, Any]) -> None:
        if body.store:
            state.responses.put(response, [*conversation, assistant_message(response["output"])])

    return keep


async def _stream(
    events: ResponseEvents, chat: SubmittedChat, timer: RequestTimer, keep: _Keep
) -> AsyncIterator[str]:
    stream = chat.stream
    final: RequestOutput | None = None
    try:
        for started in events.started():
            yield started
        async for output in stream:
            observe(timer, output)
            if output.finished:
                raise_if_failed(output)  # the failed events for this stream
            (completion,) = completions_of(output)
            for item in events.advance(completion):
                yield item
            if output.finished:
                final = output
                timer.finished(finish_reason(output))
                reasoning_tokens = chat.reasoning_tokens(completion.token_ids)
                for item in events.finished(prompt_of(output), completion, reasoning_tokens):
                    yield item
        if events.final_body is not None:
            keep(events.final_body)
    except Exception as error:  # a failed step, a dead engine: the client hears of it
        if final is None:
            timer.finished("error")
        log_unexpected(error, "a streamed response")
        for item in events.failed(from_exception(error).body()["error"]):
            yield item
    except BaseException:  # the client left (or the server stops): nobody to tell
        if final is None:
            timer.finished("abort")
        raise
    finally:
        stream.close()
