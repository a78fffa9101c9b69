"""``Engine``: the public entry point. Tokenize, schedule, run, sample, detokenize, repeat.

One step reads top to bottom in :meth:`Engine._step`: the scheduler plans, the executor runs
the plan and samples, the scheduler records the samples; the engine then detokenizes, checks
stop strings and hands each request's news to whoever waits for it (its stream, the
``generate`` call that submitted it, or ``step``; see ``requests.py``). Requests are validated
completely before anything is queued, so a rejected request leaves the engine as it was.

Threads: one lock guards the engine's state, and one thread at a time runs a step. The lock
is released while the model runs, so ``add_request``, ``abort`` and ``stats`` from other
threads return at once; ``generate`` and ``stream`` either run the next step themselves or
wait for the thread that is running it (an ``AsyncEngine`` loop, another ``generate``), and
return as soon as their own requests are done. Ctrl-C is held back while the bookkeeping
changes and raised at the next safe point (``interrupts.py``), and a step that fails halfway
is completed by the next call (:meth:`Engine._catch_up`): nothing is orphaned, nothing is
reported twice.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedinfer.adapters.attention import resolve_backend_name
from pagedinfer.adapters.executor import Executor, create_executor
from pagedinfer.adapters.models.registry import read_model_config
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.scheduler import Scheduler, SchedulerConfig
from pagedinfer.domain.sequence import FinishReason
from pagedinfer.domain.sequence import Sequence as DomainSequence
from pagedinfer.engine.config import EngineConfig, resolve_device, resolve_dtype
from pagedinfer.engine.interrupts import InterruptDeferral
from pagedinfer.engine.outputs import RequestOutput, StreamDelta
from pagedinfer.engine.progress import ProgressBar
from pagedinfer.engine.requests import CompletionState, OutputSink, RequestState
from pagedinfer.engine.streams import RequestStream
from pagedinfer.engine.tokenizer import load_tokenizer
from pagedinfer.errors import EngineClosedError, InvalidRequestError

__all__ = ["Engine", "EngineStats"]

Prompt = str | Sequence[int]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters since the engine started. Throughputs are tokens per second of step time."""

    num_requests_finished: int
    num_waiting: int
    num_running: int
    num_prompt_tokens: (
        int  # prompt tokens computed (cache hits and recomputation excluded/included as run)
    )
    num_generated_tokens: int
    prefill_throughput: float
    decode_throughput: float
    prefix_cache_hit_rate: float  # fraction of looked-up prompt tokens served from the cache
    kv_cache_usage: float  # fraction of KV blocks in use now
    num_kv_blocks: int
    num_preemptions: int


class Engine:
    """Offline LLM inference on a paged KV cache.

    ``Engine(model_path)`` loads a local Hugging Face checkpoint directory (``config.json`` +
    safetensors; tokenizer files optional). ``device="auto"`` uses CUDA when available;
    ``dtype="auto"`` follows the checkpoint on CUDA and uses float32 on the CPU. The KV cache
    has ``num_kv_blocks`` blocks of ``kv_block_size`` tokens, or is sized from free memory
    (``gpu_memory_utilization`` of the GPU, a fraction of free RAM on the CPU).
    ``attention_backend`` is ``"auto"``, ``"torch"``, ``"triton"`` or ``"flash"``.
    ``scheduling_policy="mixed"`` (the default) lets prefill chunks ride along with the
    decoding sequences' tokens in one step; ``"prefill_first"`` runs prefill steps first
    (decoding sequences wait while prompts are prefilled).
    Unknown keyword arguments raise ``TypeError``.

    Every method may be called from any thread (see docs/api.md, "Threads").
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_num_seqs: int = 512,
        max_num_batched_tokens: int = 16384,
        max_model_len: int = 4096,
        kv_block_size: int = 256,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        seed: int = 0,
        kv_cache_memory_bytes: int | None = None,
        num_threads: int | None = None,
        worker_timeout_s: float = 120.0,
        scheduling_policy: str = "mixed",
    ) -> None:
        self._executor: Executor | None = None
        self._closed = True  # until construction succeeds
        self._lock = threading.Lock()
        # Notified when a step ends, a request is finalized outside a step, or the engine closes.
        self._changed = threading.Condition(self._lock)
        config = EngineConfig(
            model_path=os.fspath(model_path),
            device=device,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            kv_block_size=kv_block_size,
            num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            attention_backend=attention_backend,
            seed=seed,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            num_threads=num_threads,
            worker_timeout_s=worker_timeout_s,
            scheduling_policy=scheduling_policy,
        )
        self.config = config
        self.model_config = read_model_config(config.model_path)
        resolved_device = resolve_device(config.device)
        self.device = resolved_device
        self.dtype = resolve_dtype(config.dtype, resolved_device, self.model_config.dtype)
        # A model cannot attend past the positions it was trained for.
        self.max_model_len = min(config.max_model_len, self.model_config.max_context_len)
        self.attention_backend = resolve_backend_name(
            config.attention_backend, resolved_device, block_size=config.kv_block_size
        )
        runner_config = RunnerConfig(
            model_path=config.model_path,
            device=resolved_device,
            dtype=self.dtype,
            block_size=config.kv_block_size,
            attention_backend=self.attention_backend,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            num_kv_blocks=config.num_kv_blocks,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enforce_eager=config.enforce_eager,
            seed=config.seed,
            tensor_parallel_size=config.tensor_parallel_size,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            num_threads=config.num_threads,
            worker_timeout_s=config.worker_timeout_s,
        )
        if config.num_threads is not None:
            # Process-wide: torch has one pool of CPU threads per process (docs/api.md).
            torch.set_num_threads(config.num_threads)
        self.tokenizer = load_tokenizer(config.model_path)
        executor = create_executor(runner_config)
        try:
            self.scheduler = Scheduler(
                SchedulerConfig(
                    num_blocks=executor.num_kv_blocks,
                    block_size=config.kv_block_size,
                    max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                    max_model_len=self.max_model_len,
                    enable_prefix_caching=config.enable_prefix_caching,
                    eos_token_ids=frozenset(self.model_config.eos_token_ids),
                    scheduling_policy=config.scheduling_policy,
                )
            )
        except BaseException:
            executor.close()
            raise
        self._executor = executor
        self._requests: dict[int, RequestState] = {}  # unfinished requests by id
        self._completions: dict[int, CompletionState] = {}  # their sequences, by sequence id
        self._step_sink = OutputSink(wants_progress=True)  # requests queued with add_request
        self._stepping = False  # a thread is running a step (possibly with the lock released)
        self._deferral = InterruptDeferral.inactive()  # of the thread that holds the lock
        # Streams dropped unfinished; aborted at the next call (see RequestStream.__del__).
        self._abandoned: deque[int] = deque()
        # A step's bookkeeping stopped halfway (an exception): the next call completes it.
        self._needs_catch_up = False
        self._next_request_id = 0
        self._num_finished = 0
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._prefill_seconds = 0.0
        self._decode_seconds = 0.0
        self._last_step = (False, 0, 0.0)  # (is_prefill, tokens, seconds) of the latest step
        self._closed = False

    # ------------------------------------------------------------------ requests
    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, *, stream: bool = False
    ) -> int:
        """Queue one request and return its id; :meth:`step` returns its outputs.

        ``stream=True`` detokenizes the request every step, so that the outputs ``step()``
        returns while it runs carry its text so far (otherwise the text arrives when it
        finishes, or every step if it has stop strings). Raises ``ValueError`` for bad input
        (and then queues nothing).
        """
        with self._locked():
            self._check_open()
            token_ids, text = self._encode(prompt)
            request = self._enqueue(
                token_ids, text, self._check_params(params), self._step_sink, streamed=stream
            )
            return request.request_id

    def abort(self, request_id: int) -> bool:
        """Finish a request now with ``finish_reason="abort"`` and free its KV blocks.

        Works in any state and from any thread; the final output goes to whoever waits for
        the request (its stream, its ``generate`` call, or :meth:`step`). False if the
        request is unknown or already finished.
        """
        with self._locked():
            self._check_open()
            self._catch_up()
            found = self._abort(request_id)
            if found:
                self._changed.notify_all()
            return found

    def has_unfinished_requests(self) -> bool:
        """Whether any request (queued by any caller) has not finished yet."""
        with self._locked():
            if not self._closed:
                self._catch_up()
            return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the news of requests queued with :meth:`add_request`.

        That is one output per such request that got tokens or finished since the previous
        ``step()`` returned, however the engine was driven meanwhile (outputs are cumulative:
        the latest state of each). Every request's final output is returned exactly once.
        If another thread is running a step, this waits for it first.
        """
        with self._locked():
            self._check_open()
            while self._stepping:
                self._wait_for_change()
                self._check_open()
            self._step()
            self._deferral.suspend()  # a held-back Ctrl-C surfaces now, before delivery
            return self._step_sink.take_outputs()

    def _step(self) -> bool:
        """One step, called with the lock held and no other step running.

        False if nothing could run. The lock is released while the model runs.
        """
        self._stepping = True
        try:
            self._catch_up()
            plan = self.scheduler.schedule()
            if plan is None:
                return False
            sampled, seconds = self._execute(plan)
            self._record(plan, sampled, seconds)
            return True
        finally:
            self._stepping = False
            self._changed.notify_all()

    def _execute(self, plan: BatchPlan) -> tuple[list[int], float]:
        assert self._executor is not None
        with self._lock_released():
            started = time.perf_counter()
            sampled = self._executor.execute(plan)
            return sampled, time.perf_counter() - started

    def _record(self, plan: BatchPlan, sampled: list[int], seconds: float) -> None:
        self._account(plan, len(sampled), seconds)
        with self._bookkeeping():
            for seq in self.scheduler.postprocess(plan, sampled):
                self._update(self._completions[seq.seq_id])

    def _update(self, completion: CompletionState) -> None:
        """After new tokens: stop strings, then news for the sink (or the final output)."""
        seq = completion.seq
        if completion.catch_up():  # a stop string matched in the text
            if not seq.is_finished:
                self.scheduler.finish(seq.seq_id, FinishReason.STOP)
            elif seq.finish_reason is FinishReason.LENGTH:  # in the same step: the stop wins
                seq.finish_reason = FinishReason.STOP
        request = completion.request
        if request.is_finished:
            self._finalize(request)
        else:
            request.sink.progressed(request)

    def _finalize(self, request: RequestState) -> None:
        """Hand the request's final output to its sink (once), then forget the request."""
        if request.final is None:
            request.finalize(self.tokenizer)
        if self._requests.pop(request.request_id, None) is not None:
            for completion in request.completions:
                del self._completions[completion.seq.seq_id]
            self._num_finished += 1

    def _abort(self, request_id: int) -> bool:
        request = self._requests.get(request_id)
        if request is None:
            return False
        with self._bookkeeping():
            for completion in request.completions:
                if not completion.seq.is_finished:
                    self.scheduler.abort(completion.seq.seq_id)
            self._finalize(request)
        return True

    @contextlib.contextmanager
    def _bookkeeping(self) -> Iterator[None]:
        """Marks changes that belong together: if one raises halfway, ``_catch_up`` ends it."""
        outer = self._needs_catch_up
        self._needs_catch_up = True
        yield
        self._needs_catch_up = outer  # not reached if the body raised

    def _catch_up(self) -> None:
        """Complete what an earlier call left undone: abort dropped streams, and finish
        bookkeeping that raised halfway (every request sees its tokens; requests that the
        scheduler finished are finalized and forgotten)."""
        if self._needs_catch_up:
            for completion in list(self._completions.values()):
                if completion.seq.seq_id not in self._completions:
                    continue  # forgotten with a sibling earlier in this loop
                if completion.request.final is not None:
                    self._finalize(completion.request)  # only forgetting it was left
                else:
                    self._update(completion)
            self._needs_catch_up = False
        while self._abandoned:
            self._abort(self._abandoned.popleft())

    # ----------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        ``prompts`` is a list of strings or a list of token-id lists (a single prompt is also
        accepted). ``sampling_params`` is one ``SamplingParams`` for all or one per prompt.
        Every prompt is validated before any is queued. Returns as soon as these requests
        are done (requests aborted meanwhile come back with ``finish_reason="abort"``); if
        it raises (Ctrl-C, a failing step), its unfinished requests are aborted.
        """
        batch = _as_prompt_list(prompts)
        sink = OutputSink(wants_progress=False)
        with self._locked():
            self._check_open()
            params = self._params_for(batch, sampling_params)
            encoded = [self._encode(prompt) for prompt in batch]
            requests = self._enqueue_all(encoded, params, sink)
            progress = ProgressBar(total=len(requests), enabled=use_tqdm)

            def report_step() -> None:
                progress.update(len(requests) - sink.num_unfinished, *self._last_step)

            try:
                self._drive(lambda: sink.num_unfinished == 0, on_step=report_step)
            except BaseException:
                for request in requests:
                    self._abort(request.request_id)
                raise
            finally:
                progress.close()
            self._deferral.suspend()  # a held-back Ctrl-C surfaces now, before delivery
            return [request.output() for request in requests]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestStream:
        """Queue one request and return an iterator over its :class:`StreamDelta` s.

        Each delta holds the tokens (and text) added since the previous one; the last has
        ``finished=True`` and the finish reason (``"abort"`` if the request was aborted).
        Iterating steps the engine (or waits for the thread that does); other requests
        advance meanwhile. ``close()`` or dropping the iterator early aborts the request.
        """
        with self._locked():
            self._check_open()
            token_ids, text = self._encode(prompt)
            sink = OutputSink(wants_progress=True)
            request = self._enqueue(
                token_ids, text, self._check_params(params), sink, streamed=True
            )
            return RequestStream(self, request)

    def _next_stream_delta(self, request: RequestState) -> StreamDelta:
        with self._locked():
            sink = request.sink
            self._drive(lambda: bool(sink.updated))
            self._deferral.suspend()  # a held-back Ctrl-C surfaces now, before delivery
            delta = request.stream_delta()
            sink.updated.clear()
            return delta

    def _abandon(self, request_id: int) -> None:
        self._abandoned.append(request_id)  # thread-safe without the lock

    def _drive(self, done: Callable[[], bool], on_step: Callable[[], None] | None = None) -> None:
        """Run steps, or wait while another thread runs them, until ``done()``.

        Raises instead of looping when nothing can run and ``done()`` is still false.
        """
        while not done():
            self._check_open()
            if self._stepping:
                self._wait_for_change()
            elif self._step():
                if on_step is not None:
                    on_step()
            elif not done():
                raise RuntimeError(
                    "the engine has nothing left to run but a caller still waits for a "
                    "request: this is a bug in pagedinfer, please report it."
                )

    # -------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        with self._locked():
            self._check_open()
            self._catch_up()
            pool = self.scheduler.pool.stats()
            scheduler = self.scheduler.stats()
            return EngineStats(
                num_requests_finished=self._num_finished,
                num_waiting=scheduler.num_waiting,
                num_running=scheduler.num_running,
                num_prompt_tokens=self._prompt_tokens,
                num_generated_tokens=self._generated_tokens,
                prefill_throughput=_rate(self._prompt_tokens, self._prefill_seconds),
                decode_throughput=_rate(self._generated_tokens, self._decode_seconds),
                prefix_cache_hit_rate=pool.prefix_hit_rate,
                kv_cache_usage=pool.usage,
                num_kv_blocks=pool.num_blocks,
                num_preemptions=scheduler.num_preemptions,
            )

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (blocks in use stay allocated)."""
        with self._locked():
            self._check_open()
            self.scheduler.pool.reset_prefix_cache()

    def _account(self, plan: BatchPlan, num_sampled: int, seconds: float) -> None:
        # A mixed step's time is shared between prefill and decode by their token counts.
        prompt_tokens = plan.num_tokens - plan.num_decode_rows
        prefill_seconds = seconds * prompt_tokens / plan.num_tokens if plan.num_tokens else 0.0
        self._prompt_tokens += prompt_tokens
        self._prefill_seconds += prefill_seconds
        self._decode_seconds += seconds - prefill_seconds
        self._generated_tokens += num_sampled
        self._last_step = (plan.is_prefill, prompt_tokens or plan.num_tokens, seconds)

    # -------------------------------------------------------------------- close
    def close(self) -> None:
        """Release the model, the KV cache and any worker processes. Idempotent.

        A step running in another thread finishes first. Unfinished requests end with
        ``finish_reason="abort"``; their streams and ``generate`` calls return them.
        """
        with self._locked():
            if self._closed:
                return
            self._closed = True
            while self._stepping:
                self._wait_for_change()
            for request_id in list(self._requests):
                self._abort(request_id)
            executor, self._executor = self._executor, None
            self._changed.notify_all()
        if executor is not None:
            executor.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ locking
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the lock, with Ctrl-C held back until the end (or the next wait)."""
        with self._lock:
            deferral = InterruptDeferral()
            self._deferral = deferral
            try:
                yield
            except BaseException:
                deferral.end(raise_pending=False)
                raise
            deferral.end()

    @contextlib.contextmanager
    def _lock_released(self) -> Iterator[None]:
        """Let other threads in (and Ctrl-C through) while this thread runs the model."""
        deferral = self._deferral
        deferral.suspend()
        self._lock.release()
        try:
            yield
        finally:
            deferral.resume()  # before acquiring, so Ctrl-C cannot break off the acquire
            self._lock.acquire()
            self._deferral = deferral

    def _wait_for_change(self) -> None:
        deferral = self._deferral
        deferral.suspend()
        try:
            self._changed.wait()
        finally:
            self._deferral = deferral
            deferral.resume()

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed; create a new Engine.")

    def _encode(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    f"the checkpoint {self.config.model_path} has no tokenizer files, so text "
                    "prompts cannot be encoded: pass token-id lists instead."
                )
            if not prompt:
                raise InvalidRequestError(
                    "the prompt is empty: a request needs at least one token."
                )
            token_ids = list(self.tokenizer.encode(prompt))
            text: str | None = prompt
        elif isinstance(prompt, Sequence):
            token_ids = list(prompt)
            text = None
        else:
            raise InvalidRequestError(
                f"a prompt must be a string or a list of token ids, not {type(prompt).__name__}."
            )
        if not token_ids:
            raise InvalidRequestError("the prompt is empty: a request needs at least one token.")
        vocab_size = self.model_config.vocab_size
        for token_id in token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise InvalidRequestError(f"token id {token_id!r} is not an integer.")
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"token id {token_id} is out of range: ids must be in [0, {vocab_size})."
                )
        limit = self.max_model_len
        if len(token_ids) + 1 > limit:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; with the first generated token that "
                f"exceeds max_model_len={limit}. Shorten the prompt to at most {limit - 1} tokens "
                "or raise max_model_len."
            )
        return token_ids, text

    @staticmethod
    def _check_params(params: SamplingParams | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling params must be a SamplingParams, not {type(params).__name__}."
            )
        _reject_unserved_fields(params)
        return params

    def _params_for(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [self._check_params(sampling_params)] * len(prompts)
        params = [self._check_params(p) for p in sampling_params]
        if len(params) != len(prompts):
            raise InvalidRequestError(
                f"got {len(params)} SamplingParams for {len(prompts)} prompts: pass one for all "
                "or exactly one per prompt."
            )
        return params

    def _enqueue(
        self,
        token_ids: list[int],
        text: str | None,
        params: SamplingParams,
        sink: OutputSink,
        *,
        streamed: bool = False,
    ) -> RequestState:
        request_id = self._next_request_id
        # One sequence per request (until n > 1); it shares the request's id.
        seq = DomainSequence(request_id, token_ids, params)
        self.scheduler.add(seq)  # validates again; raises before anything is recorded
        self._next_request_id += 1
        request = RequestState(request_id, text, sink)
        completion = CompletionState(request, seq, self.tokenizer, streamed=streamed)
        request.completions.append(completion)
        self._requests[request_id] = request
        self._completions[seq.seq_id] = completion
        sink.num_unfinished += 1
        return request

    def _enqueue_all(
        self,
        encoded: list[tuple[list[int], str | None]],
        params: list[SamplingParams],
        sink: OutputSink,
    ) -> list[RequestState]:
        """Queue a validated batch: all of it, or (if the scheduler refuses one) none."""
        requests: list[RequestState] = []
        try:
            for (token_ids, text), request_params in zip(encoded, params, strict=True):
                requests.append(self._enqueue(token_ids, text, request_params, sink))
        except BaseException:
            for request in requests:
                self._abort(request.request_id)
            raise
        return requests


# SamplingParams fields the engine does not serve yet (issue #12 wires them through), with the
# value that means "off": a request that sets one is refused rather than silently ignored.
_NOT_SERVED_YET = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
}


def _reject_unserved_fields(params: SamplingParams) -> None:
    for name, off in _NOT_SERVED_YET.items():
        if getattr(params, name) != off:
            raise InvalidRequestError(
                f"SamplingParams.{name} is not served by this engine yet: leave it at {off!r}."
            )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence):
        items: list[Any] = list(prompts)
        if items and all(isinstance(item, int) and not isinstance(item, bool) for item in items):
            return [items]  # one token-id prompt
        return items
    raise InvalidRequestError(
        f"prompts must be a list of strings or of token-id lists, not {type(prompts).__name__}."
    )


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0
