"""``POST /v1/completions``: the body checked cheapest first (its fields, its sizes against
the engine's limits, the sampling parameters), each prompt tokenized and truncated in a
worker thread, all of them queued (or none), then answered whole or streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pagedinfer.engine.async_engine import AsyncRequestStream
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.engine.prompts import TokenizedPrompt
from pagedinfer.serving.beam_search import beam_search_completions, beam_search_params
from pagedinfer.serving.failures import raise_if_failed
from pagedinfer.serving.metrics import RequestTimer
from pagedinfer.serving.prompts import Truncation, encode_prompt
from pagedinfer.serving.protocol import (
    CompletionRequest,
    check_sizes,
    completion_prompts,
    completion_sampling_params,
    echoes_prompt_only,
    truncation_limit,
)
from pagedinfer.serving.responses import (
    ChoiceCursor,
    ResponseContext,
    completion_chunk,
    completion_response,
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

__all__ = ["completions"]


async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    state.admit(body)
    engine = state.engine
    check_sizes(body, state.limits, state.vocab_size)
    beams = beam_search_params(body, engine.max_model_len)
    if beams is not None:
        return await beam_search_completions(body, request, state, beams)
    structured = structured_request(body)
    params = completion_sampling_params(body, None if structured is None else structured.params)
    params = await state.checked(params, structured)
    truncation = Truncation(truncation_limit(body, engine.max_model_len), body.truncation_side)
    prompts = await asyncio.gather(
        *(
            asyncio.to_thread(
                encode_prompt,
                engine.engine,
                prompt,
                add_special_tokens=body.add_special_tokens,
                truncation=truncation,
            )
            for prompt in completion_prompts(body)
        )
    )
    streams = _submit_all(
        lambda prompt: state.submit(prompt, params, structured, body.model), prompts
    )
    ctx = state.context("cmpl", params, body, echo=body.echo, echo_only=echoes_prompt_only(body))
    timers = [state.metrics.timer() for _ in streams]
    if body.stream:
        return event_stream(_stream(ctx, streams, timers, params.n, body.include_usage))
    try:
        outputs = await until_disconnected(
            request,
            asyncio.gather(*(final_output(s, t) for s, t in zip(streams, timers, strict=True))),
        )
    finally:
        for stream in streams:
            stream.close()  # no-op for finished streams; aborts the rest (one failed)
    return JSONResponse(completion_response(ctx, outputs, params.n))


def _submit_all(
    submit: Callable[[TokenizedPrompt], AsyncRequestStream], prompts: Sequence[TokenizedPrompt]
) -> list[AsyncRequestStream]:
    """Queue every prompt, or (if one is refused) none: the others are aborted."""
    streams: list[AsyncRequestStream] = []
    try:
        for prompt in prompts:
            streams.append(submit(prompt))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


async def _stream(
    ctx: ResponseContext,
    streams: list[AsyncRequestStream],
    timers: list[RequestTimer],
    n: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    cursors: dict[int, ChoiceCursor] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        async for prompt_index, output in _merge(streams):
            observe(timers[prompt_index], output)
            if output.finished:
                raise_if_failed(output)  # an error event for this stream, then [DONE]
            for completion in completions_of(output):
                index = prompt_index * n + completion.index
                cursor = cursors.setdefault(index, ChoiceCursor())
                chunk = completion_chunk(ctx, index, completion, cursor, prompt_of(output))
                if chunk is not None:
                    yield sse(chunk)
            if output.finished:
                finals[prompt_index] = output
                timers[prompt_index].finished(finish_reason(output))
        if include_usage:
            ordered = [finals[index] for index in sorted(finals)]
            yield sse(usage_chunk(ctx, "text_completion", ordered))
    except Exception as error:  # a failed step, a dead engine: the client hears of it
        for index, timer in enumerate(timers):
            if index not in finals:
                timer.finished("error")
        yield error_event(error, ctx)
    except BaseException:  # the client left (or the server stops): nobody to tell
        for index, timer in enumerate(timers):
            if index not in finals:
                timer.finished("abort")
        raise
    finally:
        for stream in streams:
            stream.close()  # no-op for finished streams; aborts the rest
    yield DONE


async def _merge(
    streams: list[AsyncRequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncRequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as error:
            queue.put_nowait((index, error))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
