"""The OpenAI-compatible FastAPI app around one :class:`~pagedinfer.AsyncEngine`.

Routes: ``GET /health``, ``GET /metrics``, ``GET /version``, ``GET /v1/models`` (and
``/v1/models/{id}``), ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST
/tokenize``, ``POST /detokenize``, behind a :class:`~pagedinfer.serving.guard.RequestGuard`
(Host check, API key, bounded body). A request is validated and queued before the response
starts, so bad input gets a 4xx (OpenAI's error JSON) and never a half-sent stream; the
checks run cheapest first: the fields the server does not serve
(:mod:`pagedinfer.serving.fields`), sizes against the engine's limits, then the sampling
parameters, then the prompt is tokenized (or the chat template rendered) and truncated in
a worker thread, off the event loop and without the engine's lock. A client that
disconnects gets its requests aborted (their KV blocks freed) at once: streamed responses by
Starlette's disconnect listener, the others by :func:`_until_disconnected`.

A request whose step failed gets a 500 (a stream: an error event, then ``[DONE]``); when
the engine is dead every request gets a 503 and ``/health`` too. Neither body says more
than that: the engine logs the traceback.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Body, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.engine.async_engine import AsyncEngine, AsyncRequestStream
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.engine.prompts import TokenizedPrompt
from pagedinfer.errors import InvalidStructuredOutputError
from pagedinfer.serving.errors import (
    ENGINE_DEAD_MESSAGE,
    SHUTTING_DOWN_MESSAGE,
    OpenAIError,
    error_body,
    from_exception,
    install_error_handlers,
    log_unexpected,
)
from pagedinfer.serving.failures import raise_if_failed
from pagedinfer.serving.fields import FieldPolicy
from pagedinfer.serving.guard import RequestGuard
from pagedinfer.serving.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from pagedinfer.serving.options import ServingOptions
from pagedinfer.serving.prompts import (
    ChatRendering,
    Truncation,
    decode_tokens,
    encode_chat,
    encode_prompt,
    render_chat_ids,
    token_strings,
    tokenize_text,
)
from pagedinfer.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    chat_messages,
    chat_sampling_params,
    chat_template_kwargs,
    check_fields,
    check_sizes,
    completion_prompts,
    completion_sampling_params,
    echo_prefix,
    echoes_prompt_only,
    response_role,
    truncation_limit,
)
from pagedinfer.serving.responses import (
    ChoiceCursor,
    ResponseContext,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    completions_of,
    prompt_of,
    sse,
    usage_chunk,
)
from pagedinfer.serving.structured import StructuredRequest, structured_request
from pagedinfer.serving.tools import plan_tools

__all__ = ["build_app"]

_DONE = "data: [DONE]\n\n"
_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)


def build_app(
    engine: AsyncEngine, *, served_model_name: str, options: ServingOptions | None = None
) -> FastAPI:
    """The app serving ``engine`` under the model name ``served_model_name``, admitting
    requests by ``options`` (default: no key, any Host, 1 MiB bodies).

    The app does not own the engine: whoever built it closes it (``pagedinfer serve`` does,
    after the server stops).
    """
    options = options or ServingOptions()
    app = FastAPI(title="pagedinfer", docs_url=None, redoc_url=None, openapi_url=None)
    sync_engine = engine.engine
    metrics = ServerMetrics(speculative=sync_engine.speculation is not None)
    app.state.engine = engine
    app.state.metrics = metrics
    created = int(time.time())
    limits = engine.request_limits
    vocab_size = sync_engine.model_config.vocab_size
    policy = FieldPolicy(ignore_unknown=options.ignore_unknown_fields)

    def rejected(status: int) -> None:
        metrics.requests_rejected.labels(status=str(status)).inc()

    install_error_handlers(app, on_error=rejected, redact=_redactor(engine, served_model_name))
    app.add_middleware(RequestGuard, options=options, on_reject=rejected)

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist: this server serves "
                f"`{served_model_name}` (GET /v1/models).",
                param="model",
                code="model_not_found",
            )

    def admit(body: BaseModel) -> None:
        """The checks every body passes first: its fields, its model."""
        check_fields(body, policy, trust_request_chat_template=options.trust_request_chat_template)
        check_model(getattr(body, "model", None))

    def rendering(body: ChatCompletionRequest | TokenizeChatRequest) -> ChatRendering:
        return ChatRendering(
            chat_template=body.chat_template or options.chat_template,
            template_kwargs=chat_template_kwargs(body),
            add_generation_prompt=body.generation_prompt,
            add_special_tokens=body.add_special_tokens,
        )

    token_text = _token_text(engine)
    decode = _decode(engine)
    end_texts = _eos_texts(engine)

    async def checked(
        params: SamplingParams, structured: StructuredRequest | None
    ) -> SamplingParams:
        """``params`` if the engine can serve them; a constraint is compiled (and its errors
        found) in a worker thread, off the event loop."""
        if structured is None:
            return engine.check_sampling_params(params)
        try:
            return await asyncio.to_thread(engine.check_sampling_params, params)
        except InvalidStructuredOutputError as error:
            raise structured.error(error) from None

    def submit(
        prompt: TokenizedPrompt, params: SamplingParams, structured: StructuredRequest | None
    ) -> AsyncRequestStream:
        try:
            return engine.generate(prompt, params)
        except InvalidStructuredOutputError as error:
            if structured is None:
                raise
            raise structured.error(error) from None

    def context(
        prefix: str,
        params: SamplingParams,
        body: CompletionRequest | ChatCompletionRequest,
        **fields: Any,
    ) -> ResponseContext:
        return ResponseContext(
            response_id=f"{prefix}-{body.request_id or uuid.uuid4().hex}",
            model=served_model_name,
            created=int(time.time()),
            token_text=token_text,
            num_logprobs=params.logprobs,
            return_token_ids=bool(body.return_token_ids),
            decode=decode,
            prompt_logprobs=body.prompt_logprobs is not None,
            tokens_as_ids=bool(body.return_tokens_as_token_ids),
            continuous_usage=body.stream and body.continuous_usage,
            **fields,
        )

    def model_card() -> dict[str, Any]:
        return {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "pagedinfer",
            "root": served_model_name,
            "parent": None,
            "max_model_len": engine.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            message = ENGINE_DEAD_MESSAGE if engine.is_dead else SHUTTING_DOWN_MESSAGE
            return JSONResponse(
                error_body(message, "server_error", code="engine_unavailable"), status_code=503
            )
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        stats = await engine.stats() if engine.is_running else None
        return Response(metrics.render(stats), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from pagedinfer import __version__

        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(payload: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
        body: TokenizeChatRequest | TokenizeCompletionRequest
        if "messages" in payload:
            body = _validated(TokenizeChatRequest, payload)
        else:
            body = _validated(TokenizeCompletionRequest, payload)
        admit(body)
        if isinstance(body, TokenizeChatRequest):
            messages = chat_messages(body)
            token_ids = await asyncio.to_thread(
                render_chat_ids, sync_engine, messages, rendering(body)
            )
        else:
            token_ids = await asyncio.to_thread(
                tokenize_text,
                sync_engine,
                body.prompt,
                add_special_tokens=body.add_special_tokens,
            )
        strings = None
        if body.return_token_strs:
            strings = await asyncio.to_thread(token_strings, sync_engine, token_ids)
        return {
            "count": len(token_ids),
            "max_model_len": engine.max_model_len,
            "tokens": token_ids,
            "token_strs": strings,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        admit(body)
        return {"prompt": await asyncio.to_thread(decode_tokens, sync_engine, body.tokens)}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        admit(body)
        check_sizes(body, limits, vocab_size)
        structured = structured_request(body)
        params = completion_sampling_params(body, None if structured is None else structured.params)
        params = await checked(params, structured)
        truncation = Truncation(truncation_limit(body, engine.max_model_len), body.truncation_side)
        prompts = await asyncio.gather(
            *(
                asyncio.to_thread(
                    encode_prompt,
                    sync_engine,
                    prompt,
                    add_special_tokens=body.add_special_tokens,
                    truncation=truncation,
                )
                for prompt in completion_prompts(body)
            )
        )
        streams = _submit_all(lambda prompt: submit(prompt, params, structured), prompts)
        ctx = context("cmpl", params, body, echo=body.echo, echo_only=echoes_prompt_only(body))
        timers = [metrics.timer() for _ in streams]
        if body.stream:
            events = _stream_completions(ctx, streams, timers, params.n, body.include_usage)
            return _event_stream(events)
        try:
            outputs = await _until_disconnected(
                request,
                asyncio.gather(*(_final(s, t) for s, t in zip(streams, timers, strict=True))),
            )
        finally:
            for stream in streams:
                stream.close()  # no-op for finished streams; aborts the rest (one failed)
        return JSONResponse(completion_response(ctx, outputs, params.n))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        admit(body)
        check_sizes(body, limits, vocab_size)
        tools = plan_tools(
            body.tools,
            body.tool_choice,
            body.parallel_tool_calls,
            parser=options.tool_call_parser,
            auto_tool_choice=options.enable_auto_tool_choice,
            end_texts=end_texts,
        )
        structured = structured_request(body, tools.constraint)
        params = chat_sampling_params(
            body,
            None if structured is None else structured.params,
            keep_special_tokens=tools.keeps_special_tokens,
        )
        params = await checked(params, structured)
        truncation = Truncation(truncation_limit(body, engine.max_model_len), body.truncation_side)
        prompt = await asyncio.to_thread(
            encode_chat, sync_engine, chat_messages(body), rendering(body), truncation
        )
        stream = submit(prompt, params, structured)
        ctx = context(
            "chatcmpl",
            params,
            body,
            role=response_role(body),
            echo_text=echo_prefix(body),
            prompt_text=bool(body.return_prompt_text),
            tool_calls=tools.calls,
        )
        timer = metrics.timer()
        if body.stream:
            return _event_stream(_stream_chat(ctx, stream, timer, body.include_usage))
        output = await _until_disconnected(request, _final(stream, timer))
        return JSONResponse(chat_response(ctx, output))

    return app


# ------------------------------------------------------------------------------ helpers
def _validated(model: type[_M], payload: dict[str, Any]) -> _M:
    """``payload`` parsed as ``model``; its errors answered as FastAPI's own (a 400)."""
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from None


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


async def _final(stream: AsyncRequestStream, timer: RequestTimer) -> RequestOutput:
    """Read a stream to its final output, timing its tokens."""
    output: RequestOutput | None = None
    try:
        async for output in stream:
            _observe(timer, output)
    except asyncio.CancelledError:
        timer.finished("abort")
        raise
    except Exception:
        timer.finished("error")
        raise
    assert output is not None and output.finished
    timer.finished(_finish_reason(output))
    raise_if_failed(output)  # its own input failed it: an error response for it alone
    return output


async def _until_disconnected(request: Request, work: Awaitable[_T]) -> _T:
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


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _stream_completions(
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
            _observe(timers[prompt_index], output)
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
                timers[prompt_index].finished(_finish_reason(output))
        if include_usage:
            ordered = [finals[index] for index in sorted(finals)]
            yield sse(usage_chunk(ctx, "text_completion", ordered))
    except Exception as error:  # a failed step, a dead engine: the client hears of it
        for index, timer in enumerate(timers):
            if index not in finals:
                timer.finished("error")
        yield _error_event(error, ctx)
    except BaseException:  # the client left (or the server stops): nobody to tell
        for index, timer in enumerate(timers):
            if index not in finals:
                timer.finished("abort")
        raise
    finally:
        for stream in streams:
            stream.close()  # no-op for finished streams; aborts the rest
    yield _DONE


async def _stream_chat(
    ctx: ResponseContext, stream: AsyncRequestStream, timer: RequestTimer, include_usage: bool
) -> AsyncIterator[str]:
    cursors: dict[int, ChoiceCursor] = {}
    final: RequestOutput | None = None
    try:
        async for output in stream:
            _observe(timer, output)
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
                timer.finished(_finish_reason(output))
        if include_usage and final is not None:
            yield sse(usage_chunk(ctx, "chat.completion.chunk", [final]))
    except Exception as error:  # a failed step, a dead engine: the client hears of it
        if final is None:
            timer.finished("error")
        yield _error_event(error, ctx)
    except BaseException:  # the client left (or the server stops): nobody to tell
        if final is None:
            timer.finished("abort")
        raise
    finally:
        stream.close()
    yield _DONE


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


def _error_event(error: Exception, ctx: ResponseContext) -> str:
    """The event that ends a stream that failed: OpenAI's error JSON (generic for a 5xx; the
    failure is logged, by the engine or here)."""
    log_unexpected(error, f"the stream {ctx.response_id}")
    return sse(from_exception(error).body())


def _redactor(engine: AsyncEngine, served_model_name: str) -> Callable[[str], str]:
    """Replaces the checkpoint's path (as given and absolute) in client-facing messages by
    the served name: the path stays on the server."""
    given = engine.engine.config.model_path
    paths = sorted({given, os.path.abspath(given)}, key=len, reverse=True)

    def redact(message: str) -> str:
        for path in paths:
            message = message.replace(path, served_model_name)
        return message

    return redact


def _observe(timer: RequestTimer, output: RequestOutput) -> None:
    """Tell a request's timer what has arrived: its tokens so far (the longest completion's),
    and its prompt (counted with the first token)."""
    prompt = prompt_of(output)
    num_tokens = max((len(c.token_ids) for c in completions_of(output)), default=0)
    timer.tokens(num_tokens, len(prompt.token_ids), prompt.num_cached_tokens)


def _finish_reason(output: RequestOutput) -> str | None:
    reasons = {c.finish_reason for c in completions_of(output)}
    return "abort" if "abort" in reasons else next(iter(sorted(r for r in reasons if r)), None)


def _decode(engine: AsyncEngine) -> Any:
    tokenizer = engine.tokenizer

    def decode(token_ids: Sequence[int]) -> str:
        text: str = tokenizer.decode(list(token_ids)) if tokenizer is not None else ""
        return text

    return decode


def _eos_texts(engine: AsyncEngine) -> tuple[str, ...]:
    """The text of each EOS token (an answer decoded with its special tokens ends with one,
    which a tool-call parser leaves out)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return ()
    eos_ids = engine.engine.model_config.eos_token_ids
    return tuple(text for text in (tokenizer.decode([i]) for i in eos_ids) if text)


def _token_text(engine: AsyncEngine) -> Any:
    tokenizer = engine.tokenizer

    def token_text(token_id: int) -> str:
        if tokenizer is None:
            return f"token_id:{token_id}"
        text: str = tokenizer.decode([token_id])
        return text

    return token_text
