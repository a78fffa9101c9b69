"""``POST /v1/chat/completions``: the body checked cheapest first (its fields, its sizes,
the tools, the sampling parameters), the chat template rendered and tokenized in a worker
thread, then answered whole or streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pagedinfer.engine.async_engine import AsyncRequestStream
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.serving.failures import raise_if_failed
from pagedinfer.serving.metrics import RequestTimer
from pagedinfer.serving.prompts import Truncation, encode_chat
from pagedinfer.serving.protocol import (
    ChatCompletionRequest,
    chat_messages,
    chat_sampling_params,
    check_sizes,
    echo_prefix,
    response_role,
    truncation_limit,
)
from pagedinfer.serving.reasoning.plan import plan_reasoning
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
from pagedinfer.serving.structured import structured_request
from pagedinfer.serving.tools import plan_tools

__all__ = ["chat_completions"]


async def chat_completions(body: ChatCompletionRequest, request: Request, state: State) -> Response:
    state.admit(body)
    engine, options = state.engine, state.options
    check_sizes(body, state.limits, state.vocab_size)
    tools = plan_tools(
        body.tools,
        body.tool_choice,
        body.parallel_tool_calls,
        parser=options.tool_call_parser,
        auto_tool_choice=options.enable_auto_tool_choice,
        end_texts=state.end_texts,
    )
    structured = structured_request(body, tools.constraint)
    params = chat_sampling_params(
        body,
        None if structured is None else structured.params,
        keep_special_tokens=tools.keeps_special_tokens,
    )
    params = await state.checked(params, structured)
    truncation = Truncation(truncation_limit(body, engine.max_model_len), body.truncation_side)
    rendering = state.rendering(body)
    prompt = await asyncio.to_thread(
        encode_chat, engine.engine, chat_messages(body), rendering, truncation
    )
    reasoning = plan_reasoning(
        state.reasoning,
        state.reasoning_end,
        include_reasoning=body.include_reasoning,
        prompt_text=prompt.text
        if prompt.text is not None
        else state.decode(prompt.token_ids[-32:]),
        template_kwargs=rendering.template_kwargs,
        continued=body.continue_final_message,
    )
    if structured is not None:
        params = reasoning.gated(params, structured.field)
    stream = state.submit(prompt, params, structured)
    ctx = state.context(
        "chatcmpl",
        params,
        body,
        role=response_role(body),
        echo_text=echo_prefix(body),
        prompt_text=bool(body.return_prompt_text),
        tool_calls=tools.calls,
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
