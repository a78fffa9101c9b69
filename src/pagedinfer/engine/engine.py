"""``Engine``: the public entry point. Tokenize, schedule, run, sample, detokenize, repeat.

One step reads top to bottom in :meth:`Engine._step`: the scheduler plans, the executor runs
the plan and samples, the scheduler records the samples; the engine then detokenizes, checks
stop strings and hands each request's news to whoever waits for it (its stream, the
``generate`` call that submitted it, or ``step``; see ``requests.py``). Requests are validated
completely before anything is queued, so a rejected request leaves the engine as it was.

Threads: one lock guards the engine's state, and one thread at a time runs a step. Prompts
are tokenized and validated before the lock is taken (``prompts.py``), and the lock is
released while the model runs, so ``add_request``, ``abort`` and ``stats`` from other
threads return at once; ``generate`` and ``stream`` either run the next step themselves or
wait for the thread that is running it (an ``AsyncEngine`` loop, another ``generate``), and
return as soon as their own requests are done; a ``step()`` that had to wait counts the step
it waited for as its own. Ctrl-C is held back while the bookkeeping changes and raised at the
next safe point (``interrupts.py``), and bookkeeping that fails halfway is completed by the
next call (:meth:`Engine._catch_up`): nothing is orphaned, nothing is reported twice. When
the executor fails, the step's requests fail and the others go on, unless the failure is
fatal (``failures.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from pagedinfer.adapters.attention import resolve_backend_name
from pagedinfer.adapters.executor import ModelExecutor, create_executor
from pagedinfer.adapters.kv_cache import kv_cache_dtype_name, resolve_kv_cache_dtype
from pagedinfer.adapters.models.registry import read_model_config
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.adapters.sampling.grammar import GrammarCompiler
from pagedinfer.domain.forks import completion_seed, make_forks
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.scheduler import Scheduler, SchedulerConfig
from pagedinfer.domain.sequence import FinishReason, SequenceStatus
from pagedinfer.domain.sequence import Sequence as DomainSequence
from pagedinfer.domain.step_output import StepOutput, TokenLogprobs
from pagedinfer.engine.chat import render_chat
from pagedinfer.engine.config import (
    EngineConfig,
    EngineOptions,
    engine_signature,
    resolve_async_scheduling,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
    resolve_num_threads,
)
from pagedinfer.engine.failed_requests import end_failed_samples
from pagedinfer.engine.failures import StepFailures, is_fatal
from pagedinfer.engine.interrupts import InterruptDeferral
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.engine.progress import ProgressBar
from pagedinfer.engine.prompts import (
    Prompt,
    PromptEncoder,
    PromptInput,
    TokenizedPrompt,
    parse_prompts,
)
from pagedinfer.engine.requests import CompletionState, OutputSink, RequestState
from pagedinfer.engine.streams import RequestStream
from pagedinfer.engine.tokenizer import TOKENIZER_FILES, load_tokenizer
from pagedinfer.errors import (
    CheckpointNotFoundError,
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    InvalidStructuredOutputError,
    StepFailedError,
    UnsupportedModelError,
)

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; only read by type checkers here

__all__ = ["Engine", "EngineStats", "Prompt", "TokenizedPrompt", "completion_seed"]

_logger = logging.getLogger(__name__)


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
    # Speculative decoding (vLLM's spec_decode counters): verify rows with drafts, drafts
    # verified, drafts accepted, and drafts accepted at each position of a row.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted drafts / drafts verified (0.0 before any)."""
        drafts = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafts if drafts else 0.0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens per verify row: 1 + accepted drafts per row (0.0 before any)."""
        rows = self.spec_decode_num_drafts
        return 1.0 + self.spec_decode_num_accepted_tokens / rows if rows else 0.0


class Engine:
    """Offline LLM inference on a paged KV cache.

    ``Engine(model)`` (vLLM's keyword: ``Engine(model=DIR)``) loads a local Hugging Face
    checkpoint directory (``config.json`` + safetensors; tokenizer files optional); a Hub
    id that is not a local directory is refused, saying how to download it.
    ``device="auto"`` uses CUDA when available; ``dtype="auto"`` follows the checkpoint on
    CUDA and uses float32 on the CPU. The KV cache has ``num_kv_blocks`` blocks of
    ``kv_block_size`` tokens, or is sized from free memory (``gpu_memory_utilization`` of the
    GPU, a fraction of free RAM on the CPU).
    ``attention_backend`` is ``"auto"``, ``"torch"``, ``"triton"`` or ``"flash"``.
    ``kv_cache_dtype`` (vLLM's names) is ``"auto"`` (the model's dtype), ``"fp8"`` /
    ``"fp8_e4m3"`` or ``"fp8_e5m2"``: one byte per element, twice the blocks of a 16-bit cache
    in the same memory, with per-layer scales from the checkpoint or calibrated at start-up
    (not with the ``flash`` backend; docs/models.md).
    ``scheduling_policy="mixed"`` (the default) lets prefill chunks ride along with the
    decoding sequences' tokens in one step; ``"prefill_first"`` runs prefill steps first
    (decoding sequences wait while prompts are prefilled).
    ``max_model_len`` (``None``: 4096, or the model's limit if lower) beyond the model's
    limit raises ``ConfigurationError`` naming the limit. ``num_threads`` sets torch's CPU
    threads, which are process-wide: ``"auto"`` (the default) is half the CPUs this process
    may use, ``None`` leaves them alone. ``tokenizer`` is another directory to load the tokenizer
    from; ``skip_tokenizer_init=True`` loads none (token-id prompts only, empty texts).
    ``max_n``, ``max_logprobs``, ``max_stop`` and ``max_stop_str_len`` bound what one
    request may ask for (:class:`~pagedinfer.domain.limits.RequestLimits`, resolved in
    :attr:`request_limits`). A failed step fails its requests
    (:class:`~pagedinfer.errors.StepFailedError`); ``max_consecutive_failed_steps`` failed
    steps in a row, or a fatal failure, make the engine dead
    (:class:`~pagedinfer.errors.EngineDeadError`). ``weight_check`` picks the checkpoint
    tensors that must hold no NaN or infinity at load (``"default"``: scales, norms, biases;
    ``"all"``: every tensor, slower; ``"none"``; docs/models.md): a bad one raises
    :class:`~pagedinfer.errors.NonFiniteWeightError` naming it. Unknown keyword arguments
    raise ``TypeError``.

    Every method may be called from any thread (see docs/api.md, "Threads").
    """

    def __init__(self, model: str | os.PathLike[str], **options: Unpack[EngineOptions]) -> None:
        self._executor: ModelExecutor | None = None
        self._closed = True  # until construction succeeds
        self._lock = threading.Lock()
        # Notified when a step ends, a request is finalized outside a step, or the engine closes.
        self._changed = threading.Condition(self._lock)
        # The options, their defaults and their checks: engine/config.py (EngineConfig).
        config = EngineConfig.from_options(model, options)
        self.config = config
        # Speculative decoding (docs/speculative-decoding.md): how drafts are proposed.
        self.speculation = config.speculation
        self.model_config = read_model_config(config.model_path)
        # What a request without sampling parameters gets (generation_config.json, as vLLM).
        self.default_sampling_params = config.default_sampling_params()
        resolved_device = resolve_device(config.device)
        self.device = resolved_device
        self.dtype = resolve_dtype(config.dtype, resolved_device, self.model_config.dtype)
        # Never silently below what was asked: beyond the model's limit is an error naming it.
        self.max_model_len = resolve_max_model_len(
            config.max_model_len,
            self.model_config.max_context_len,
            self.model_config.sliding_window,
        )
        self.model_config.check_max_model_len(self.max_model_len)
        # One step in flight: the next step is planned and launched before this one's tokens
        # are back (docs/architecture.md, "The step loop").
        self.async_scheduling = resolve_async_scheduling(config, resolved_device)
        num_threads = resolve_num_threads(config.num_threads, config.tensor_parallel_size)
        self.attention_backend = resolve_backend_name(
            config.attention_backend,
            resolved_device,
            block_size=config.kv_block_size,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        # The KV cache's element type (the model's dtype, or float8).
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
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
            num_threads=num_threads,
            worker_timeout_s=config.worker_timeout_s,
            kv_cache_dtype=config.kv_cache_dtype,
            pipeline_parallel_size=config.pipeline_parallel_size,
            distributed_executor_backend=config.distributed_executor_backend,
            draft_model_path=(
                self.speculation.model
                if self.speculation is not None and self.speculation.method == "draft_model"
                else None
            ),
            num_speculative_tokens=(
                0 if self.speculation is None else self.speculation.num_speculative_tokens
            ),
            weight_check=config.weight_check,
        )
        if num_threads is not None:
            # Process-wide (torch has one pool of CPU threads per process): None leaves torch's
            # setting alone (docs/api.md, num_threads).
            torch.set_num_threads(num_threads)
        self.tokenizer = _tokenizer(config)
        vocab_size = self.model_config.vocab_size
        self._prompts = PromptEncoder(
            self.tokenizer,
            vocab_size=vocab_size,
            max_model_len=self.max_model_len,
            model_path=config.model_path,
        )
        # Structured outputs: grammars compile (and are probed) at submission
        # (check_sampling_params) under the grammar limits; each request carries its own.
        self._grammars = GrammarCompiler(
            self.tokenizer,
            vocab_size,
            self.model_config.eos_token_ids,
            limits=config.grammar_limits,
        )
        executor = create_executor(runner_config, grammars=self._grammars)
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
                    num_speculative_tokens=runner_config.num_speculative_tokens,
                    # A draft model writes the K/V of its next drafts past a verify row.
                    num_lookahead_tokens=(
                        runner_config.num_speculative_tokens
                        if runner_config.draft_model_path is not None
                        else 0
                    ),
                )
            )
        except BaseException:
            executor.close()
            raise
        limits = config.request_limits
        # Resolved: -1 is the vocabulary; n also fits what runs at once.
        self.request_limits = dataclasses.replace(
            limits,
            max_n=min(limits.max_n, self.scheduler.config.max_running),
            max_logprobs=limits.max_logprobs_for(vocab_size),
        )
        self._executor = executor
        self._requests: dict[int, RequestState] = {}  # unfinished requests by id
        self._completions: dict[int, CompletionState] = {}  # their sequences, by sequence id
        # Unfinished requests that need every step's news (see RequestState.follows_steps);
        # while there are none, a step's bookkeeping looks only at what finished.
        self._num_following = 0
        self._step_sink = OutputSink(wants_progress=True)  # requests queued with add_request
        self._stepping = False  # a thread is running a step (possibly with the lock released)
        self._steps_done = 0  # steps run to their end (recorded or failed), by any thread
        self._failures = StepFailures(config.max_consecutive_failed_steps)
        self._dead: BaseException | None = None  # why the engine died (a fatal step failure)
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
        # Async scheduling: steps launched and not recorded yet, oldest first (at most two:
        # the one the host waits for and the one planned ahead of it), run in order by one
        # worker thread; and the requests with structured outputs, which plan no step ahead.
        self._flights: deque[_Flight] = deque()
        self._worker: ThreadPoolExecutor | None = None
        self._structured: set[int] = set()
        self._closed = False

    # What help() and inspect show: every option, keyword-only, with its default.
    __init__.__signature__ = engine_signature()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: Prompt) -> TokenizedPrompt:
        """Tokenize and validate one prompt, without touching the engine's state.

        ``prompt`` is any prompt form (a string, token ids, ``{"prompt": ...}``,
        ``{"prompt_token_ids": ...}``, a ``TokenizedPrompt``). The result is accepted by
        every method that takes a prompt and is not tokenized again. Takes no lock: call it
        from any thread, e.g. a worker thread for a long text (``AsyncEngine.tokenize``).
        Raises ``InvalidRequestError`` for an empty prompt, an id outside the vocabulary or
        a prompt too long for ``max_model_len`` (the length is checked before the ids).
        """
        return self._prompts.encode(prompt)

    def tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> TokenizedPrompt:
        """One conversation rendered by the chat template and tokenized, as :meth:`chat`
        does (``text`` is the rendered template). Takes no lock, like :meth:`tokenize`."""
        rendered = render_chat(
            self.tokenizer,
            messages,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            model_path=self.config.model_path,
        )
        if len(rendered) != 1:
            raise InvalidRequestError(
                f"one conversation (a list of messages) was expected, got {len(rendered)}: "
                "render them one at a time."
            )
        return self._prompts.encode(rendered[0])

    def check_sampling_params(self, params: SamplingParams | None) -> SamplingParams:
        """``params`` (``None``: the defaults) if this engine can serve them, else
        ``InvalidRequestError`` naming the field and the limit.

        Sizes are checked first, in time independent of their values (:attr:`request_limits`,
        ``n`` against what runs at once); then token ids against the vocabulary. Takes no
        lock. Every method that takes parameters runs these checks; call it to refuse a
        request before tokenizing its prompt. A ``structured_outputs`` constraint is compiled
        and probed under the grammar limits (``InvalidStructuredOutputError`` if refused); the
        returned copy carries the compiled grammar, which the request keeps until it ends
        (passing the returned params on skips compiling again).
        """
        if params is None:
            return self.default_sampling_params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling params must be a SamplingParams, not {type(params).__name__}."
            )
        max_running = self.scheduler.config.max_running
        if params.n > max_running:
            raise InvalidRequestError(
                f"SamplingParams.n={params.n} completions cannot run at once: at most "
                f"min(max_num_seqs, max_num_batched_tokens)={max_running} sequences run "
                "together. Lower n or raise max_num_seqs."
            )
        vocab_size = self.model_config.vocab_size
        self.request_limits.check(params, vocab_size=vocab_size)
        largest = params.max_token_id()  # bounded: each id list is at most the vocabulary
        if largest is not None and largest >= vocab_size:
            raise InvalidRequestError(
                f"SamplingParams names token id {largest} (stop_token_ids, allowed_token_ids or "
                f"logit_bias), but the model's ids are in [0, {vocab_size})."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab_size:
                raise InvalidRequestError(
                    f"SamplingParams.{name}={value} exceeds the vocabulary ({vocab_size} tokens)."
                )
        if params.allowed_token_ids is not None and params.min_tokens > 0:
            held = set(params.stop_token_ids)
            if not params.ignore_eos:
                held.update(self.model_config.eos_token_ids)
            if held.issuperset(params.allowed_token_ids):
                raise InvalidRequestError(
                    "SamplingParams.allowed_token_ids holds only EOS / stop tokens, which "
                    "min_tokens holds back: nothing could be generated. Allow other tokens or "
                    "set min_tokens=0."
                )
        if params.structured_outputs is not None and self.speculation is not None:
            raise InvalidRequestError(
                "structured_outputs cannot run with speculative decoding on this engine (the "
                "grammar would have to check every draft; not implemented): send the request "
                "to an engine without speculative_config, or drop structured_outputs."
            )
        constraint = params.structured_outputs
        if constraint is not None and self._grammars.pinned(constraint) is None:
            # Compiled and probed here, in the caller's thread and before any lock (shared
            # by its key): a constraint that does not compile, passes a grammar limit or
            # accepts no string is refused now, and a slow one does not stall the steps. The
            # request carries its compiled grammar to the sampling rank: no compile in step().
            try:
                compiled = self._grammars.compile(constraint)
            except InvalidStructuredOutputError as error:
                _logger.info("refused a structured-output constraint: %s", error)
                raise
            params = dataclasses.replace(
                params, structured_outputs=constraint.with_compiled(compiled)
            )
        return params

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, *, stream: bool = False
    ) -> str:
        """Queue one request and return its id (a string, as ``RequestOutput.request_id``);
        :meth:`step` returns its outputs.

        ``prompt`` is a string, a list of token ids, ``{"prompt": str}``,
        ``{"prompt_token_ids": [...]}`` or a :class:`TokenizedPrompt`. ``stream=True``
        detokenizes the request every step, so that the outputs ``step()`` returns while it
        runs carry its text so far (otherwise the text arrives when it finishes, or every
        step if it has stop strings). Raises ``ValueError`` for bad input (and then queues
        nothing). The prompt is tokenized before the engine's lock is taken.
        """
        checked = self.check_sampling_params(params)
        tokenized = self._prompts.encode(prompt)
        with self._locked():
            self._check_open()
            request = self._enqueue(tokenized, checked, self._step_sink, streamed=stream)
            return request.name

    def abort(self, request_id: str) -> bool:
        """Finish a request now with ``finish_reason="abort"`` and free its KV blocks.

        Works in any state and from any thread; the final output goes to whoever waits for
        the request (its stream, its ``generate`` call, or :meth:`step`). False if the
        request is unknown or already finished (on a dead engine every request is).
        ``request_id`` is a string (``RequestOutput.request_id``, what :meth:`add_request`
        returned); anything else raises ``TypeError``.
        """
        key = _request_key(request_id)
        with self._locked():
            if self._dead is not None and not self._closed:
                return False
            self._check_open()
            self._catch_up()
            found = key is not None and self._abort(key)
            if found:
                self._changed.notify_all()
            return found

    def has_unfinished_requests(self) -> bool:
        """Whether any request (queued by any caller) has not finished yet."""
        with self._locked():
            if not self._closed:
                self._catch_up()
            return bool(self._requests)

    @property
    def is_dead(self) -> bool:
        """True once a fatal failure ended the engine (every call but ``stats``, ``abort``,
        ``has_unfinished_requests`` and ``close`` raises ``EngineDeadError``)."""
        return self._dead is not None

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the news of requests queued with :meth:`add_request`.

        That is one output per such request that got tokens or finished since the previous
        ``step()`` returned, however the engine was driven meanwhile (outputs are cumulative:
        the latest state of each). Every request's final output is returned exactly once.
        If another thread is running a step, this waits for that step to end and counts it
        as its own (so ``step()`` keeps pace with threads that step all the time).

        If a step failed since the previous call and ended ``add_request`` requests, this
        raises :class:`~pagedinfer.errors.StepFailedError` naming them (their final outputs,
        ``"abort"``, come with the next call); ``EngineDeadError`` once the engine is dead.
        """
        with self._locked():
            self._check_open()
            steps_done = self._steps_done
            while self._stepping and self._steps_done == steps_done:
                self._wait_for_change()
                self._check_open()
            if self._steps_done == steps_done:  # no step ended meanwhile: run one
                with contextlib.suppress(StepFailedError):  # reported through the sinks
                    self._step()
            self._deferral.suspend()  # a held-back Ctrl-C surfaces now, before delivery
            self._raise_failure(self._step_sink)
            return self._step_sink.take_outputs()

    def _step(self) -> bool:
        """One step, called with the lock held and no other step running.

        False if nothing could run. The lock is released while the model runs. Raises
        ``StepFailedError`` if the executor failed (the step's requests are ended), or
        ``EngineDeadError`` if that failure was fatal.
        """
        self._stepping = True
        try:
            self._catch_up()
            if self.async_scheduling:
                return self._step_ahead()
            plan = self.scheduler.schedule()
            if plan is None:
                return False
            try:
                output, seconds = self._execute(plan)
            except EngineClosedError:
                raise
            except Exception as error:
                self._steps_done += 1
                self._fail_step(plan, error)
            self._failures.succeeded()
            self._steps_done += 1
            self._record(plan, output, seconds)
            return True
        finally:
            self._stepping = False
            self._changed.notify_all()

    def _step_ahead(self) -> bool:
        """:meth:`_step` with one step in flight (async scheduling): launch a step if none
        is in flight, plan and launch the next one before the oldest one's tokens are known
        (``Scheduler.schedule_ahead``), then wait for the oldest and record it. The worker
        thread runs the steps in launch order while this thread plans and records."""
        flights = self._flights
        scheduler = self.scheduler
        if not flights:
            plan = scheduler.schedule()
            if plan is None:
                return False
            flights.append(self._launch(plan, None))
        if len(flights) == 1 and not self._structured:
            ahead = scheduler.schedule_ahead()
            if ahead is not None:
                flights.append(self._launch(ahead, flights[0]))
        flight = flights[0]
        try:
            with self._lock_released():
                read_output, started = flight.future.result()
                output = read_output()  # waits for this step only
                seconds = time.perf_counter() - started
        except EngineClosedError:
            raise
        except Exception as error:
            # The step planned ahead read this one's tokens: it fails with it (its requests
            # too), and the next schedule() rolls both back (Scheduler.schedule_ahead).
            dropped = [other.plan for other in flights if other is not flight]
            for other in flights:
                other.future.cancel()
            flights.clear()
            self._steps_done += 1
            self._fail_step(flight.plan, error, dropped)
        flights.popleft()
        self._failures.succeeded()
        self._steps_done += 1
        self._record(flight.plan, output, seconds)
        return True

    def _launch(self, plan: BatchPlan, previous: _Flight | None) -> _Flight:
        """Queue ``plan`` on the worker thread (after ``previous``, whose sampled tokens it
        carries if it was planned ahead of them)."""
        executor = self._executor
        assert executor is not None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedinfer-step")
        host_carry = bool(plan.carried_rows) and not getattr(
            executor, "reads_carried_tokens", False
        )
        # An executor that launches a step without waiting for it (ModelRunner.launch) lets
        # the next one queue up behind it on the device; the host thread reads the output.
        launch: Callable[[BatchPlan], Callable[[], StepOutput]] | None = getattr(
            executor, "launch", None
        )

        def run() -> tuple[Callable[[], StepOutput], float]:
            started = time.perf_counter()
            ready = plan
            if host_carry:  # the executor cannot read them on its device: fill them in here
                assert previous is not None
                read_previous = previous.future.result()[0]
                ready = _with_carried_tokens(plan, read_previous())
            if launch is not None:
                read_output = launch(ready)
            else:
                output = executor.execute(ready)

                def read_output() -> StepOutput:
                    return output

            return read_output, started

        return _Flight(plan, self._worker.submit(run))

    def _fail_step(
        self, plan: BatchPlan, error: Exception, dropped: Sequence[BatchPlan] = ()
    ) -> NoReturn:
        """The executor raised ``error`` running ``plan``: end the requests with a row in it
        or in the ``dropped`` plans (launched behind it, on its tokens) (``"abort"``), tell
        their consumers, raise. Fatal, or one failure too many in a row: the engine dies
        instead (every unfinished request ends)."""
        tensor_parallel = self.config.tensor_parallel_size > 1
        if self._failures.failed() or is_fatal(error, tensor_parallel=tensor_parallel):
            self._die(error)
        failed: dict[int, RequestState] = {}
        rows = [seq_id for each in (plan, *dropped) for seq_id in each.seq_ids]
        rows += [seq_id for each in (plan, *dropped) for seq_id in each.sampled_seq_ids]
        for seq_id in rows:
            completion = self._completions.get(seq_id)
            if completion is not None and completion.request.final is None:
                failed.setdefault(completion.request.request_id, completion.request)
        for request in failed.values():
            request.error = error
            request.sink.fail(request.name, error, dead=False)
            self._abort(request.request_id)
        if not failed:  # every row was aborted while the step ran: nobody will raise this
            _logger.error(
                "a step failed after its requests were aborted; the engine goes on",
                exc_info=error,
            )
        names = tuple(failed[key].name for key in sorted(failed))
        raise StepFailedError(
            f"a step failed ({type(error).__name__}: {error}); its requests "
            f"{list(names)} were aborted and the engine goes on.",
            names,
        ) from error

    def _die(self, error: BaseException) -> NoReturn:
        """A fatal failure: end every unfinished request ("abort"), raise from now on."""
        self._dead = error
        for request in list(self._requests.values()):
            request.error = error
            request.sink.fail(request.name, error, dead=True)
            self._abort(request.request_id)
        self._changed.notify_all()
        raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        cause = self._dead
        if isinstance(cause, EngineDeadError):
            # A dead worker says so itself (WorkerDiedError is an EngineDeadError): raise a
            # fresh copy of it, so ``except WorkerTimeoutError`` works and tracebacks do not
            # pile up on one instance.
            copy = type(cause)(*cause.args)
            copy.__cause__ = cause
            return copy
        failures = self._failures
        why = (
            f"{failures.in_a_row} steps failed in a row"
            if failures.in_a_row >= failures.limit
            else "a step failed in a way the engine cannot recover from"
        )
        error = EngineDeadError(
            f"the engine is dead: {why} ({type(cause).__name__}: {cause}). Every "
            "unfinished request was aborted; close this Engine and create a new one."
        )
        error.__cause__ = cause
        return error

    def _raise_failure(self, sink: OutputSink) -> None:
        """Raise what ended requests of ``sink`` (once), if a failed step or death did."""
        if sink.dead:
            raise self._dead_error()
        if sink.failed:
            ids, cause = tuple(sink.failed), sink.failure
            sink.failed = []
            error = StepFailedError(
                f"a step failed ({type(cause).__name__}: {cause}); requests {list(ids)} had "
                "a row in it and were aborted. The engine goes on serving other requests.",
                ids,
            )
            raise error from cause

    def _execute(self, plan: BatchPlan) -> tuple[StepOutput, float]:
        assert self._executor is not None
        with self._lock_released():
            started = time.perf_counter()
            output = self._executor.execute(plan)
            return output, time.perf_counter() - started

    def _record(self, plan: BatchPlan, output: StepOutput, seconds: float) -> None:
        sampled = output.sampled_token_ids
        self._account(plan, len(sampled), seconds)
        with self._bookkeeping():
            for chunk in output.prompt_logprobs:
                owner = self._completions.get(chunk.seq_id)
                if owner is not None:
                    owner.request.set_prompt_logprobs(
                        chunk.first_position, chunk.entries, self.tokenizer
                    )
            logprobs: dict[int, list[TokenLogprobs | None]] | None = None
            if output.logprobs is not None:
                logprobs = {}
                for seq_id, entry in zip(plan.sampled_seq_ids, output.logprobs, strict=True):
                    logprobs.setdefault(seq_id, []).append(entry)
            accepted = self.scheduler.num_accepted_tokens
            failed = None
            if output.failed_samples:  # their own input failed them: they end, nothing else
                failed = end_failed_samples(
                    plan, output.failed_samples, self._completions, self.scheduler
                )
            seqs = self.scheduler.postprocess(plan, sampled)
            if failed:
                self._update(failed)
            if plan.verify_rows:  # samples after a rejected draft are not generated tokens
                drafts = sum(count for _, _, count in plan.verify_rows)
                self._generated_tokens -= drafts - (self.scheduler.num_accepted_tokens - accepted)
            if self.speculation is not None:
                self._propose(seqs, output.draft_token_ids)
            if logprobs is None and not self._num_following:
                self._finalize_finished(seqs)
                return
            updated = [self._completions[seq.seq_id] for seq in seqs]
            if logprobs is not None:
                for completion in updated:
                    entries = logprobs.get(completion.seq.seq_id)
                    if entries is not None:
                        completion.add_logprobs(entries, self.tokenizer)
            self._update(updated)

    def _propose(self, seqs: list[DomainSequence], drafted: Mapping[int, list[int]] | None) -> None:
        """Speculative decoding: drafts for the sequences that just got tokens: the draft
        model's (proposed in the step, ``drafted``), or the n-gram lookup over their tokens."""
        speculation = self.speculation
        assert speculation is not None
        scheduler = self.scheduler
        running = SequenceStatus.RUNNING
        k = speculation.num_speculative_tokens
        for seq in seqs:
            if seq.status is running and seq.num_uncomputed_tokens == 1:
                if drafted is not None:
                    drafts = drafted.get(seq.seq_id, [])
                elif speculation.method == "ngram":
                    drafts = speculation.propose(seq.token_ids, k)
                else:
                    continue
                scheduler.set_drafts(seq.seq_id, drafts)

    def _finalize_finished(self, seqs: list[DomainSequence]) -> None:
        """:meth:`_update` when no request follows every step (no text is tracked, no sink
        shows progress): only requests whose last sequence just finished have news."""
        finished = SequenceStatus.FINISHED
        for seq in [seq for seq in seqs if seq.status is finished]:
            completion = self._completions.get(seq.seq_id)
            # None: its request was finalized by a sibling that finished in this step.
            if completion is not None and completion.request.is_finished:
                self._finalize(completion.request)

    def _update(self, completions: list[CompletionState]) -> None:
        """After new tokens: stop strings (every completion first), then news for each
        request's sink (or its final output)."""
        for completion in completions:
            seq = completion.seq
            if completion.text is not None and completion.catch_up():  # a stop string matched
                if not seq.is_finished:
                    self.scheduler.finish(seq.seq_id, FinishReason.STOP)
                elif seq.finish_reason is FinishReason.LENGTH:  # the same step: the stop wins
                    seq.finish_reason = FinishReason.STOP
                completion.drop_surplus_tokens()
        requests = {id(c.request): c.request for c in completions}  # in order, once each
        for request in requests.values():
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
            self._structured.discard(request.request_id)
            if request.follows_steps:
                self._num_following -= 1

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
            pending = []
            for completion in list(self._completions.values()):
                if completion.request.final is not None:
                    self._finalize(completion.request)  # only forgetting it was left
                else:
                    pending.append(completion)
            self._update(pending)
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

        ``prompts`` is one prompt or a list: strings, token-id lists, ``{"prompt": str}``,
        ``{"prompt_token_ids": [...]}`` or :class:`TokenizedPrompt` s. ``sampling_params`` is
        one ``SamplingParams`` for all or one per prompt. Every prompt is tokenized and
        validated (before the engine's lock is taken) before any is queued. Returns as soon
        as these requests are done (requests aborted meanwhile come back with
        ``finish_reason="abort"``); if it raises (Ctrl-C; ``StepFailedError`` when a step
        that held some of them failed; ``EngineDeadError``), its unfinished requests are
        aborted.
        """
        return self._generate(parse_prompts(prompts), sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """:meth:`generate` for one conversation or a list of them, rendered by the
        tokenizer's chat template (or ``chat_template``).

        A conversation is a list of ``{"role": ..., "content": ...}`` dicts.
        ``chat_template_kwargs`` reach the template as variables (Qwen3's
        ``enable_thinking``). Each output's ``prompt`` is the rendered text. Without a
        template this raises ``ValueError``.
        """
        rendered = render_chat(
            self.tokenizer,
            messages,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            model_path=self.config.model_path,
        )
        return self._generate(list(rendered), sampling_params, use_tqdm)

    def _generate(
        self,
        batch: list[PromptInput | TokenizedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        # Parameters first (cheap refusals), then every prompt, all before the lock.
        params = self._params_for(batch, sampling_params)
        prompts = [self._prompts.encode(prompt) for prompt in batch]
        sink = OutputSink(wants_progress=False)
        with self._locked():
            self._check_open()
            requests = self._enqueue_all(prompts, params, sink)
            progress = ProgressBar(
                total=len(requests),
                enabled=use_tqdm,
                spec_decode=None if self.speculation is None else self.scheduler.stats,
            )

            def report_step() -> None:
                progress.update(len(requests) - sink.num_unfinished, *self._last_step)

            try:
                self._drive(sink, lambda: sink.num_unfinished == 0, on_step=report_step)
            except BaseException:
                for request in requests:
                    self._abort(request.request_id)
                raise
            finally:
                progress.close()
            self._deferral.suspend()  # a held-back Ctrl-C surfaces now, before delivery
            return [request.output() for request in requests]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestStream:
        """Queue one request and return an iterator over its deltas.

        Each delta is a :class:`RequestOutput` holding only what is new since the previous
        one: the completions that got tokens (their new tokens, text and logprobs) or just
        finished (with their finish reason); ``prompt_logprobs`` in the first delta only.
        The last has ``finished=True`` (finish reason ``"abort"`` if the request was
        aborted). Iterating steps the engine (or waits for the thread that does); other
        requests advance meanwhile. ``close()`` or dropping the iterator early aborts the
        request. If a step the request was in fails, iterating raises ``StepFailedError``.
        """
        checked = self.check_sampling_params(params)
        tokenized = self._prompts.encode(prompt)
        with self._locked():
            self._check_open()
            sink = OutputSink(wants_progress=True)
            request = self._enqueue(tokenized, checked, sink, streamed=True)
            return RequestStream(self, request)

    def _next_stream_delta(self, request: RequestState) -> RequestOutput:
        with self._locked():
            sink = request.sink
            self._drive(sink, lambda: bool(sink.updated))
            self._deferral.suspend()  # a held-back Ctrl-C surfaces now, before delivery
            delta = request.stream_delta()
            sink.updated.clear()
            return delta

    def _abandon(self, request_id: int) -> None:
        self._abandoned.append(request_id)  # thread-safe without the lock

    def _drive(
        self,
        sink: OutputSink,
        done: Callable[[], bool],
        on_step: Callable[[], None] | None = None,
    ) -> None:
        """Run steps, or wait while another thread runs them, until ``done()``.

        Raises what ended requests of ``sink`` (a failed step: ``StepFailedError``; the
        engine's death: ``EngineDeadError``), whichever thread ran that step. A failed step
        that held none of them is not this caller's business: it steps on. Raises instead
        of looping when nothing can run and ``done()`` is still false.
        """
        while True:
            self._raise_failure(sink)
            if done():
                return
            self._check_open()
            if self._stepping:
                self._wait_for_change()
                continue
            try:
                stepped = self._step()
            except StepFailedError:
                continue  # its requests' consumers raise it (this one at the loop's top)
            if stepped:
                if on_step is not None:
                    on_step()
            elif not done():
                raise RuntimeError(
                    "the engine has nothing left to run but a caller still waits for a "
                    "request: this is a bug in pagedinfer, please report it."
                )

    # -------------------------------------------------------------------- stats
    def describe(self) -> str:
        """One line for a start-up log: the model and how it runs (device, dtype, attention
        backend, KV cache and its dtype when FP8, ``max_model_len``). Takes no lock (everything
        in it is fixed)."""
        scheduler = self.scheduler.config
        tp = self.config.tensor_parallel_size
        kv_dtype = ""
        if self.kv_cache_dtype != self.dtype:
            kv_dtype = f" ({kv_cache_dtype_name(self.kv_cache_dtype)})"
        return (
            f"model {self.config.model_path} ({self.model_config.architecture}): device "
            f"{self.device}, dtype {str(self.dtype).removeprefix('torch.')}, attention "
            f"{self.attention_backend}, {scheduler.num_blocks} KV blocks of "
            f"{scheduler.block_size} tokens{kv_dtype}, max_model_len {self.max_model_len}"
            + (f", tensor_parallel_size {tp}" if tp > 1 else "")
            + (f", quantization {q.describe()}" if (q := self.model_config.quantization) else "")
        )

    def stats(self) -> EngineStats:
        """The counters; also on a dead engine (what it did before it died)."""
        with self._locked():
            if self._closed:
                raise EngineClosedError("the engine is closed; create a new Engine.")
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
                spec_decode_num_drafts=scheduler.num_spec_verify_rows,
                spec_decode_num_draft_tokens=scheduler.num_draft_tokens,
                spec_decode_num_accepted_tokens=scheduler.num_accepted_tokens,
                spec_decode_num_accepted_tokens_per_pos=scheduler.accepted_per_position,
            )

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (blocks in use stay allocated)."""
        with self._locked():
            self._check_open()
            self.scheduler.pool.reset_prefix_cache()

    def _account(self, plan: BatchPlan, num_sampled: int, seconds: float) -> None:
        # A mixed step's time is shared between prefill and decode by their token counts
        # (speculative decoding's verify rows are chunks, but decoding work).
        prompt_tokens = plan.num_tokens - plan.num_decode_rows - plan.num_generation_tokens
        prefill_seconds = seconds * prompt_tokens / plan.num_tokens if plan.num_tokens else 0.0
        self._prompt_tokens += prompt_tokens
        self._prefill_seconds += prefill_seconds
        self._decode_seconds += seconds - prefill_seconds
        self._generated_tokens += num_sampled
        self._last_step = (prompt_tokens > 0, prompt_tokens or plan.num_tokens, seconds)

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
            worker, self._worker = self._worker, None
            self._flights.clear()
            self._changed.notify_all()
        if worker is not None:
            worker.shutdown(wait=True)  # a step still in flight ends before the executor
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
        if self._dead is not None:
            raise self._dead_error()

    def _params_for(
        self,
        prompts: list[PromptInput | TokenizedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [self.check_sampling_params(sampling_params)] * len(prompts)
        if len(sampling_params) != len(prompts):  # before checking any of them
            raise InvalidRequestError(
                f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts: pass "
                "one for all or exactly one per prompt."
            )
        return [self.check_sampling_params(p) for p in sampling_params]

    def _enqueue(
        self,
        prompt: TokenizedPrompt,
        params: SamplingParams,
        sink: OutputSink,
        *,
        streamed: bool = False,
    ) -> RequestState:
        token_ids, text = prompt.token_ids, prompt.text
        request_id = self._next_request_id
        # One sequence per completion; the first shares the request's id and prefills the
        # prompt, the others fork from it (completion i is seeded completion_seed(seed, i)).
        seqs = [DomainSequence(request_id, token_ids, params)]
        seqs += make_forks(seqs[0])
        self.scheduler.add(seqs[0], forks=seqs[1:])  # validates; raises before anything is kept
        self._next_request_id += params.n
        request = RequestState(
            request_id,
            text,
            sink,
            eos_token_ids=self.model_config.eos_token_ids,
            num_prompt_tokens=len(token_ids),
            wants_prompt_logprobs=params.prompt_logprobs is not None,
        )
        for index, seq in enumerate(seqs):
            completion = CompletionState(
                request, seq, self.tokenizer, streamed=streamed, index=index
            )
            request.completions.append(completion)
            self._completions[seq.seq_id] = completion
        self._requests[request_id] = request
        if params.structured_outputs is not None:
            self._structured.add(request_id)
        if request.follows_steps:
            self._num_following += 1
        sink.num_unfinished += 1
        return request

    def _enqueue_all(
        self,
        prompts: list[TokenizedPrompt],
        params: list[SamplingParams],
        sink: OutputSink,
    ) -> list[RequestState]:
        """Queue a validated batch: all of it, or (if the scheduler refuses one) none."""
        requests: list[RequestState] = []
        try:
            for prompt, request_params in zip(prompts, params, strict=True):
                requests.append(self._enqueue(prompt, request_params, sink))
        except BaseException:
            for request in requests:
                self._abort(request.request_id)
            raise
        return requests


@dataclass(frozen=True, slots=True)
class _Flight:
    """A step launched on the worker thread and not recorded yet."""

    plan: BatchPlan
    # What reads its output, and when the worker thread started it (perf_counter).
    future: Future[tuple[Callable[[], StepOutput], float]]


def _with_carried_tokens(plan: BatchPlan, previous: StepOutput) -> BatchPlan:
    """``plan`` with its carried rows' input ids filled in from the previous step's samples
    (for executors that do not read them from their device)."""
    input_ids = array("q", plan.input_ids)
    sampled = previous.sampled_token_ids
    for row, sample in zip(plan.carried_rows, plan.carried_samples, strict=True):
        input_ids[row] = sampled[sample]
    return dataclasses.replace(
        plan, input_ids=input_ids, carried_rows=array("q"), carried_samples=array("q")
    )


def _tokenizer(config: EngineConfig) -> Any:
    """The tokenizer ``config`` asks for: none, the model directory's, or another
    directory's (which must hold one)."""
    if config.skip_tokenizer_init:
        return None
    if config.tokenizer is None:
        return load_tokenizer(config.model_path)
    directory = os.fspath(config.tokenizer)
    if not os.path.isdir(directory):
        raise CheckpointNotFoundError(
            f"tokenizer={directory!r} is not a directory: pass the local directory that holds "
            "the tokenizer files (tokenizer.json, tokenizer_config.json, ...), or leave "
            "tokenizer out to use the model directory's. pagedinfer never downloads; get a "
            "Hub tokenizer with: hf download REPO --local-dir DIR"
        )
    tokenizer = load_tokenizer(directory)
    if tokenizer is None:
        raise UnsupportedModelError(
            f"tokenizer={directory!r} holds no tokenizer files (one of "
            f"{', '.join(TOKENIZER_FILES)}): pass a directory that does."
        )
    return tokenizer


def _request_key(request_id: str) -> int | None:
    """The engine's key of the request named ``request_id`` (the decimal form of the key),
    or None if no request can have that name."""
    if not isinstance(request_id, str):
        raise TypeError(
            f"request ids are strings (RequestOutput.request_id, what add_request returned), "
            f"got {type(request_id).__name__} {request_id!r}."
        )
    if not (request_id.isascii() and request_id.isdigit()) or len(request_id) > 20:
        return None
    key = int(request_id)
    return key if str(key) == request_id else None  # "01" names no request


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0
