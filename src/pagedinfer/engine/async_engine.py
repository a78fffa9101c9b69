"""``AsyncEngine``: the :class:`~pagedinfer.Engine` for asyncio programs (servers).

One background thread drives the engine's step loop; coroutines submit requests and read
their outputs. There is no second scheduler: every request, from any coroutine, joins the
same continuous batch of the same ``Engine``.

Thread model (built on the Engine's, see docs/api.md "Threads"):

* the *step thread* (one, owned by the AsyncEngine) calls ``Engine.step()`` while any request
  is unfinished, and sleeps otherwise;
* event-loop threads call ``Engine.add_request`` and ``Engine.abort`` directly. The Engine
  releases its lock while the model runs, so these return at once; they wait at most for the
  bookkeeping part of a step;
* after each step, the step thread hands that step's outputs to the event loop of each
  waiting consumer in one ``call_soon_threadsafe`` call per loop (not one per request);
* prompts are tokenized before any lock is taken: ``await tokenize()`` (or
  ``tokenize_chat()``) runs it in a worker thread, so a long prompt blocks neither the event
  loop nor the step thread.

Failures: a step that fails (``StepFailedError``) is logged with its traceback on the
``pagedinfer.engine.async_engine`` logger, the streams of its requests raise
``StepFailedError`` and the loop goes on. Anything else the step thread meets (the Engine
dead, a bug) is logged too and ends the AsyncEngine: every waiting stream and every later
request raises ``EngineDeadError``, and the callbacks registered with :meth:`AsyncEngine.on_dead`
run once.

Outputs are *cumulative* (as vLLM's default ``RequestOutputKind.CUMULATIVE``): every output
holds the request's whole completion so far, and its text only ever grows (text that could
still turn out to be the start of a stop string is held back until it cannot). A consumer
that falls behind skips intermediate outputs and gets the latest, never a stale one; the
final output (``finished=True``) always arrives.

Everything that knows how the Engine is driven (its method names, its output type) is in
:class:`_EngineLink`, so a change of the Engine's thread model or output shape is one edit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from pagedinfer.domain.limits import RequestLimits
from pagedinfer.domain.lora import LoRARequest
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.engine.engine import Engine, EngineStats, Prompt
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.engine.prompts import TokenizedPrompt
from pagedinfer.engine.weight_sync import RpcMethod, Weights
from pagedinfer.errors import (
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    StepFailedError,
)

__all__ = ["AsyncEngine", "AsyncRequestStream"]

_logger = logging.getLogger(__name__)

_PAUSED_POLL_S = 0.05
"""While the engine is paused, how often the step thread looks whether it was resumed
(``Engine.resume_generation`` called directly, not through the AsyncEngine)."""


class _EngineLink:
    """The only code that calls the Engine: submit, abort, step, stats.

    Called from two kinds of threads: ``add``, ``abort`` and ``stats`` from event loops,
    ``step`` and ``has_work`` from the step thread. The Engine's lock makes that safe.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def add(
        self, prompt: TokenizedPrompt, params: SamplingParams, lora: LoRARequest | None = None
    ) -> str:
        # stream=True: the Engine tracks the text every step, so outputs carry it.
        return self.engine.add_request(prompt, params, stream=True, lora_request=lora)

    def abort(self, engine_id: str) -> bool:
        return self.engine.abort(engine_id)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def paused(self) -> bool:
        return self.engine.is_paused()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @staticmethod
    def engine_id(output: RequestOutput) -> str:
        return output.request_id


class AsyncRequestStream(AsyncIterator[RequestOutput]):
    """The outputs of one request (cumulative), ending with the one whose ``finished`` is True.

    ``request_id`` is the request's name (given to :meth:`AsyncEngine.generate`, or a fresh
    ``"req-N"``): what :meth:`AsyncEngine.abort` takes, and every output's ``request_id``.

    Made by :meth:`AsyncEngine.generate` / :meth:`AsyncEngine.chat`, which queue the request
    at once (so bad input raises there, before anything is awaited). Cancelling the task that
    awaits the next output, ``aclose()``, or dropping the stream unfinished aborts the request
    and frees its KV blocks. If a step that held the request fails, waiting raises
    ``StepFailedError``; if the engine dies, ``EngineDeadError``.
    """

    def __init__(
        self,
        owner: AsyncEngine,
        engine_id: str,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.request_id = request_id
        self._owner = owner
        self._engine_id = engine_id
        self._loop = loop
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._done = False

    def __aiter__(self) -> AsyncRequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while self._latest is None and self._error is None:
            waiter = self._loop.create_future()
            self._waiter = waiter
            try:
                await waiter
            except BaseException:
                # The consumer was cancelled (or interrupted): nobody will read this request.
                self.close()
                raise
            finally:
                self._waiter = None
        output = self._latest
        if output is None:
            self._done = True
            assert self._error is not None
            raise self._error
        self._latest = None
        if output.request_id != self.request_id:  # the Engine's id: show the stream's
            output = dataclasses.replace(output, request_id=self.request_id)
        if output.finished:
            self._done = True
            self._owner._unregister(self)
        return output

    def close(self) -> None:
        """Abort the request unless it finished already (without waiting). Idempotent."""
        if not self._done:
            self._done = True
            self._owner._abort_soon(self._engine_id, self.request_id)

    async def aclose(self) -> None:
        """:meth:`close`, for ``contextlib.aclosing`` and async-iterator conventions."""
        self.close()

    # Called on this stream's event loop by the AsyncEngine.
    def _push(self, output: RequestOutput) -> None:
        if self._done:
            return
        self._latest = output  # cumulative: the newest output replaces an unread one
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if not self._done:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __del__(self) -> None:
        # Dropped unfinished (a consumer left its loop). Garbage collection may run in any
        # thread, even one that holds the AsyncEngine's lock: _abort_soon takes no lock.
        if not self._done:
            self._done = True
            with contextlib.suppress(Exception):
                self._owner._abort_soon(self._engine_id, self.request_id)


class AsyncEngine:
    """An :class:`~pagedinfer.Engine` driven by a background thread, for asyncio code.

    ``AsyncEngine(model_path, **engine_kwargs)`` takes ``Engine``'s arguments and loads the
    model (blocking: build it before serving, or in a thread). ``AsyncEngine.from_engine``
    wraps an existing ``Engine`` and takes ownership of it. ::

        async with AsyncEngine(model_dir) as engine:
            async for output in engine.generate("Hello", SamplingParams(max_tokens=32)):
                print(output.outputs[0].text)  # cumulative: everything so far

    Requests from any number of coroutines batch together. ``close()`` (or leaving ``async
    with``) ends unfinished requests with ``finish_reason="abort"`` and releases the engine.
    """

    def __init__(self, model_path: str | os.PathLike[str], **engine_kwargs: Any) -> None:
        self._start(Engine(model_path, **engine_kwargs))

    @classmethod
    def from_engine(cls, engine: Engine) -> AsyncEngine:
        """Drive an existing ``Engine`` (nobody else may use it afterwards)."""
        self = cls.__new__(cls)
        self._start(engine)
        return self

    def _start(self, engine: Engine) -> None:
        self.engine = engine
        self._link = _EngineLink(engine)
        self._lock = threading.Lock()  # guards the three tables below
        # By the Engine's request id. Weak: a stream its consumer dropped must be collectable,
        # so that its __del__ aborts the request.
        self._streams: weakref.WeakValueDictionary[str, AsyncRequestStream] = (
            weakref.WeakValueDictionary()
        )
        self._ids: dict[str, str] = {}  # request_id -> the Engine's id
        # (engine id, request id) of streams whose consumer left; the step thread aborts
        # them before its next step.
        self._abandoned: deque[tuple[str, str]] = deque()
        self._wake = threading.Event()
        self._error: BaseException | None = None
        self._dead_callbacks: list[Callable[[BaseException], None]] = []  # under _lock
        self._closing = False
        self._closed = False
        self._names = itertools.count()
        self._thread = threading.Thread(target=self._run, name="pagedinfer-step-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ properties
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def request_limits(self) -> RequestLimits:
        """The Engine's :attr:`~pagedinfer.Engine.request_limits`."""
        return self.engine.request_limits

    @property
    def is_dead(self) -> bool:
        """True once a step raised: the engine serves nothing more (``dead_error`` says why)."""
        return self._error is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._error

    @property
    def is_running(self) -> bool:
        return not self._closing and self._error is None

    # -------------------------------------------------------------------- requests
    def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncRequestStream:
        """Queue one request; ``async for`` over the result yields its outputs as tokens arrive.

        ``prompt`` is a string, a list of token ids, or a :class:`TokenizedPrompt` from
        :meth:`tokenize` (a text is tokenized here, on the event loop: await
        :meth:`tokenize` first for long ones). ``request_id`` names the request for
        :meth:`abort` (default: a fresh id); an id still in use raises ``ValueError``. Bad
        input raises here (``ValueError``), before anything is queued. Must be called from a
        running event loop. ``lora_request``: a LoRA adapter (``enable_lora``; docs/lora.md),
        checked here (its files' header is read once per adapter).
        """
        loop = asyncio.get_running_loop()
        self._check_serving()
        params = self.engine.check_sampling_params(sampling_params)
        lora = self.engine.loras.check(lora_request)
        # Before any lock: a text prompt is tokenized here, on the event loop. For long
        # texts, ``await tokenize(prompt)`` first (a worker thread) and pass its result.
        tokenized = self.engine.tokenize(prompt)
        with self._lock:
            if request_id is not None and request_id in self._ids:
                raise InvalidRequestError(
                    f"request_id {request_id!r} is already in use by an unfinished request: "
                    "choose another id (or leave it out for a fresh one)."
                )
            # Registered under the lock, so the step thread cannot deliver an output for
            # this request before its stream exists.
            engine_id = self._link.add(tokenized, params, lora)
            name = request_id if request_id is not None else f"req-{next(self._names)}"
            stream = AsyncRequestStream(self, engine_id, name, loop)
            self._streams[engine_id] = stream
            self._ids[name] = engine_id
        self._wake.set()
        return stream

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncRequestStream:
        """:meth:`generate` for one conversation, rendered by the tokenizer's chat template.

        ``messages`` is a list of ``{"role": ..., "content": ...}`` dicts;
        ``chat_template_kwargs`` reach the template (Qwen3's ``enable_thinking``). Without a
        template (the tokenizer's or ``chat_template``) this raises ``ValueError``.
        """
        prompt = self.engine.tokenize_chat(
            messages,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
        )
        return self.generate(prompt, sampling_params, request_id, lora_request)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The prompt token ids of a conversation (what :meth:`chat` generates from),
        validated like :meth:`tokenize`'s. Takes no lock and touches no event loop: safe to
        call from a worker thread (``asyncio.to_thread``)."""
        return list(
            self.engine.tokenize_chat(
                messages,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
            ).token_ids
        )

    async def tokenize(self, prompt: Prompt) -> TokenizedPrompt:
        """:meth:`Engine.tokenize <pagedinfer.Engine.tokenize>` in a worker thread: the
        prompt tokenized and validated, for :meth:`generate`. Neither the event loop nor the
        step thread waits for it."""
        return await asyncio.to_thread(self.engine.tokenize, prompt)

    async def tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> TokenizedPrompt:
        """One conversation rendered by the chat template and tokenized, in a worker
        thread (``Engine.tokenize_chat``); pass the result to :meth:`generate`."""
        return await asyncio.to_thread(
            self.engine.tokenize_chat,
            messages,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
        )

    def check_sampling_params(self, params: SamplingParams | None) -> SamplingParams:
        """:meth:`Engine.check_sampling_params <pagedinfer.Engine.check_sampling_params>`:
        refuse parameters the engine cannot serve (``InvalidRequestError``) before the
        prompt is tokenized. Cheap; safe on the event loop."""
        return self.engine.check_sampling_params(params)

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` once when the engine dies (``error`` is
        :attr:`dead_error`), from the step thread; at once if it is dead already. A
        server uses it to exit so that a supervisor restarts it. An exception raised by the
        callback is logged."""
        with self._lock:
            error = self._error
            if error is None:
                self._dead_callbacks.append(callback)
                return
        _call_dead_callback(callback, error)

    async def abort(self, request_id: str) -> bool:
        """Abort a request: its stream yields a final output with ``finish_reason="abort"``.

        False if the id is unknown or the request already finished.
        """
        with self._lock:
            engine_id = self._ids.get(request_id)
        if engine_id is None or self._error is not None or self._closing:
            return False
        try:
            found = self._link.abort(engine_id)
        except EngineClosedError:
            return False
        self._wake.set()  # the step thread delivers the final output
        return found

    async def stats(self) -> EngineStats:
        """The engine's counters (``Engine.stats()``)."""
        self._check_open()
        return self._link.stats()

    # ------------------------------------------------- sleep and pause (sleep_pause.py)
    async def sleep(self, level: int = 1) -> None:
        """``Engine.sleep`` in a worker thread: free the KV cache (level 2: the weights too);
        new requests raise ``EngineSleepingError`` until :meth:`wake_up`."""
        self._check_open()
        await asyncio.to_thread(self.engine.sleep, level)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """``Engine.wake_up`` in a worker thread (``tags``: ``"weights"``, ``"kv_cache"``)."""
        self._check_open()
        await asyncio.to_thread(self.engine.wake_up, tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    async def pause_generation(self, timeout: float | None = 60.0) -> None:
        """``Engine.pause_generation`` in a worker thread: returns once the running step has
        ended; streams wait (their requests stay queued) until :meth:`resume_generation`."""
        self._check_open()
        await asyncio.to_thread(self.engine.pause_generation, timeout)

    async def resume_generation(self) -> None:
        """Let steps run again."""
        self._check_open()
        self.engine.resume_generation()
        self._wake.set()

    def is_paused(self) -> bool:
        return self.engine.is_paused()

    async def update_weights(self, weights: Weights) -> None:
        """``Engine.update_weights`` in a worker thread (docs/rl.md): between requests, so
        with any unfinished it raises ``RequestsInFlightError``."""
        self._check_open()
        await asyncio.to_thread(self.engine.update_weights, weights)

    async def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """``Engine.collective_rpc`` in a worker thread, between two steps."""
        self._check_open()
        return await asyncio.to_thread(self.engine.collective_rpc, method, timeout, args, kwargs)

    # ----------------------------------------------------------------------- close
    def close(self) -> None:
        """Stop the step thread, end unfinished requests (``"abort"``), release the engine.

        Idempotent. Blocks until the current step ends; from a coroutine prefer ``async
        with`` (which runs this in a worker thread).
        """
        if self._closed:
            return
        self._closing = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._closed = True
        if self._error is None:
            # Final outputs ("abort") for whoever still waits: abort, then collect them with
            # a step that has nothing left to run.
            with contextlib.suppress(Exception):
                self._abort_abandoned()
                with self._lock:
                    engine_ids = list(self._streams)
                for engine_id in engine_ids:
                    self._link.abort(engine_id)
                self._dispatch(self._link.step())
        closed = EngineClosedError("the AsyncEngine was closed; create a new one.")
        self._fail_all(closed)
        self.engine.close()

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.close)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed:
                self.close()

    # ----------------------------------------------------------------- step thread
    def _run(self) -> None:
        link = self._link
        try:
            while True:
                if not self._abandoned and not link.has_work():
                    self._wake.wait()
                elif link.paused():  # resume_generation wakes it; a poll for the Engine's
                    self._wake.wait(_PAUSED_POLL_S)
                self._wake.clear()  # after the wait: a later wake-up is never lost
                if self._closing:
                    return
                self._abort_abandoned()
                try:
                    outputs = link.step()
                except StepFailedError as failure:
                    _logger.error(
                        "a step failed: requests %s were aborted; serving the others",
                        list(failure.request_ids),
                        exc_info=failure,
                    )
                    self._fail_requests(failure)
                    continue
                self._dispatch(outputs)
        except BaseException as error:  # the engine failed: nobody may wait forever
            if self._closing and isinstance(error, EngineClosedError):
                return
            _logger.error("the engine failed and serves no more requests", exc_info=error)
            with self._lock:
                self._error = error
                callbacks, self._dead_callbacks = self._dead_callbacks, []
            self._fail_all(
                EngineDeadError(
                    f"the engine failed and serves no more requests: {error!r}. Close this "
                    "AsyncEngine and create a new one."
                ),
                cause=error,
            )
            for callback in callbacks:
                _call_dead_callback(callback, error)

    def _fail_requests(self, failure: StepFailedError) -> None:
        """The streams of a failed step's requests raise ``StepFailedError`` (their final
        outputs, "abort", come with the next step and go nowhere)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[AsyncRequestStream, Any]]] = {}
        with self._lock:
            for engine_id in failure.request_ids:
                stream = self._streams.get(engine_id)
                if stream is None:
                    continue
                self._forget(engine_id, stream.request_id)
                error = StepFailedError(
                    f"request {stream.request_id!r} was aborted: a step it was part of failed "
                    "(the server's log has the details). Other requests are served; retry it.",
                    (stream.request_id,),
                )
                error.__cause__ = failure.__cause__
                by_loop.setdefault(stream._loop, []).append((stream, error))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_fail_each, items)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one call per event loop."""
        if not outputs:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[AsyncRequestStream, Any]]] = {}
        with self._lock:
            for output in outputs:
                engine_id = self._link.engine_id(output)
                stream = self._streams.get(engine_id)
                if stream is None:
                    continue  # aborted by a consumer that left; nobody waits
                if output.finished:
                    self._forget(engine_id, stream.request_id)
                by_loop.setdefault(stream._loop, []).append((stream, output))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_deliver, items)

    def _fail_all(self, error: BaseException, cause: BaseException | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self._ids.clear()
        by_loop: dict[asyncio.AbstractEventLoop, list[AsyncRequestStream]] = {}
        for stream in streams:
            by_loop.setdefault(stream._loop, []).append(stream)
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_fail, items, error)

    # ------------------------------------------------------------------- internals
    def _abort_soon(self, engine_id: str, request_id: str) -> None:
        """A consumer left: the step thread forgets its stream and aborts the request before
        its next step. Takes no lock (see ``AsyncRequestStream.__del__``)."""
        self._abandoned.append((engine_id, request_id))
        self._wake.set()

    def _abort_abandoned(self) -> None:
        while self._abandoned:
            engine_id, request_id = self._abandoned.popleft()
            with self._lock:
                self._forget(engine_id, request_id)
            # False if it finished meanwhile (the Engine never reuses an id).
            self._link.abort(engine_id)

    def _unregister(self, stream: AsyncRequestStream) -> None:
        with self._lock:
            self._forget(stream._engine_id, stream.request_id)

    def _forget(self, engine_id: str, request_id: str) -> None:
        """Drop a request from the tables, if it is there (the lock is held)."""
        self._streams.pop(engine_id, None)
        if self._ids.get(request_id) == engine_id:
            del self._ids[request_id]

    def _check_open(self) -> None:
        if self._closing:
            raise EngineClosedError("the AsyncEngine is closed; create a new one.")

    def _check_serving(self) -> None:
        self._check_open()
        if self._error is not None:
            raise EngineDeadError(
                f"the engine failed earlier and serves no more requests: {self._error!r}. "
                "Close this AsyncEngine and create a new one."
            ) from self._error


def _deliver(items: list[tuple[AsyncRequestStream, RequestOutput]]) -> None:
    for stream, output in items:
        stream._push(output)


def _fail(streams: list[AsyncRequestStream], error: BaseException) -> None:
    for stream in streams:
        stream._fail(error)


def _fail_each(items: list[tuple[AsyncRequestStream, BaseException]]) -> None:
    for stream, error in items:
        stream._fail(error)


def _call_dead_callback(callback: Callable[[BaseException], None], error: BaseException) -> None:
    try:
        callback(error)
    except Exception:
        _logger.exception("an AsyncEngine.on_dead callback raised")
