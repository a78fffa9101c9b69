"""``Engine``: the public entry point. Tokenize, schedule, run, sample, detokenize, repeat.

One step reads top to bottom in :meth:`Engine._step` (or :meth:`Engine._step_ahead`, with
one step in flight): the scheduler plans, the executor runs the plan and samples, the
engine records the samples. Each concern has its own module: admission (``admission.py``:
the one check of sampling parameters, before the lock, then queueing), the steps in flight
(``in_flight.py``), output processing (``output_processor.py``: record, stop strings,
final outputs, aborts, accounting) over the table of unfinished requests
(``request_table.py``), and what a failed step means (``failures.py``). Requests are
validated completely before anything is queued, so a rejected request leaves the engine as
it was; each request's news goes to whoever waits for it (its stream, the ``generate`` call
that submitted it, or ``step``; see ``requests.py``).

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
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from pagedinfer.adapters.attention import resolve_backend_name
from pagedinfer.adapters.executor import ModelExecutor, create_executor
from pagedinfer.adapters.kv_cache import resolve_kv_cache_dtype
from pagedinfer.adapters.models.registry import read_model_config
from pagedinfer.adapters.sampling.grammar import GrammarCompiler
from pagedinfer.domain.forks import completion_seed
from pagedinfer.domain.lora import Lora, LoRARequest
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.scheduler import Scheduler
from pagedinfer.domain.step_output import StepOutput
from pagedinfer.engine.admission import Admission
from pagedinfer.engine.chat import render_chat
from pagedinfer.engine.component_configs import runner_config, scheduler_config
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
from pagedinfer.engine.engine_lock import EngineLock
from pagedinfer.engine.failures import (
    StepFailures,
    dead_engine_error,
    failed_step_error,
    is_fatal,
)
from pagedinfer.engine.in_flight import InFlight
from pagedinfer.engine.lora import LoRAMethods, LoRARegistry
from pagedinfer.engine.output_processor import OutputProcessor
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.engine.pooling_setup import pooling_engine_config, pooling_setup
from pagedinfer.engine.progress import ProgressBar
from pagedinfer.engine.prompts import (
    Prompt,
    PromptEncoder,
    PromptInput,
    TokenizedPrompt,
    parse_prompts,
)
from pagedinfer.engine.reports import EngineReports
from pagedinfer.engine.request_table import RequestTable
from pagedinfer.engine.requests import OutputSink, RequestState, request_key
from pagedinfer.engine.sleep_pause import GenerationControls, SleepAndPause
from pagedinfer.engine.stats import EngineStats
from pagedinfer.engine.streams import RequestStream
from pagedinfer.engine.tokenizer import tokenizer_for
from pagedinfer.engine.weight_sync import WeightSync
from pagedinfer.errors import (
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    StepFailedError,
)

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; only read by type checkers here

__all__ = ["Engine", "EngineStats", "Prompt", "TokenizedPrompt", "completion_seed"]

_logger = logging.getLogger(__name__)


class Engine(EngineReports, SleepAndPause, WeightSync, LoRAMethods):
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
        self._guard = EngineLock()  # one thread at a time, Ctrl-C held back (engine_lock.py)
        self._lock = self._guard.lock
        # The options, their defaults and their checks: engine/config.py (EngineConfig).
        config = EngineConfig.from_options(model, options)
        # A pooling model (runner="pooling", docs/pooling.md): how it pools, and what it
        # changes in the engine's options (engine/pooling_setup.py).
        self.pooling = pooling_setup(config.runner, config.model_path, config.pooler_config)
        config = pooling_engine_config(config, self.pooling)
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
            config.max_model_len, self.model_config.max_context_len
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
        runner = runner_config(
            config,
            device=resolved_device,
            dtype=self.dtype,
            attention_backend=self.attention_backend,
            max_model_len=self.max_model_len,
            num_threads=num_threads,
            pooling_type=None if self.pooling is None else self.pooling.pooling_type,
        )
        if num_threads is not None:
            # Process-wide (torch has one pool of CPU threads per process): None leaves torch's
            # setting alone (docs/api.md, num_threads).
            torch.set_num_threads(num_threads)
        self.tokenizer = tokenizer_for(
            config.model_path, config.tokenizer, skip_tokenizer_init=config.skip_tokenizer_init
        )
        vocab_size = self.model_config.vocab_size
        self._prompts = PromptEncoder(
            self.tokenizer,
            vocab_size=vocab_size,
            max_model_len=self.max_model_len,
            model_path=config.model_path,
        )
        # Structured outputs: grammars compile (and are probed) at submission, within limits.
        self._grammars = GrammarCompiler(
            self.tokenizer,
            vocab_size,
            self.model_config.eos_token_ids,
            limits=config.grammar_limits,
        )
        executor = create_executor(runner, grammars=self._grammars)
        try:
            self.scheduler = Scheduler(
                scheduler_config(
                    config,
                    runner,
                    num_blocks=executor.num_kv_blocks,
                    num_host_blocks=executor.num_host_kv_blocks,
                    eos_token_ids=self.model_config.eos_token_ids,
                    kv_groups=executor.kv_groups,
                )
            )
        except BaseException:
            executor.close()
            raise
        self._admission = Admission(
            limits=config.request_limits,
            max_running=self.scheduler.config.max_running,
            vocab_size=vocab_size,
            eos_token_ids=self.model_config.eos_token_ids,
            grammars=self._grammars,
            speculative=self.speculation is not None,
            defaults=self.default_sampling_params,
            pooling=self.pooling is not None,
        )
        self.request_limits = self._admission.limits  # resolved (-1, n against max_running)
        self.loras = LoRARegistry.for_engine(config, self.model_config)
        self._executor = executor
        self._table = RequestTable()  # the unfinished requests
        self._outputs = OutputProcessor(self.scheduler, self.tokenizer, self._table)
        self._step_sink = OutputSink(wants_progress=True)  # requests queued with add_request
        self._stepping = False  # a thread is running a step (possibly with the lock released)
        self._steps_done = 0  # steps run to their end (recorded or failed), by any thread
        self._failures = StepFailures(config.max_consecutive_failed_steps)
        self._dead: BaseException | None = None  # why the engine died (a fatal step failure)
        # Streams dropped unfinished; aborted at the next call (see RequestStream.__del__).
        self._abandoned: deque[int] = deque()
        # Async scheduling: the steps launched and not recorded yet (in_flight.py).
        self._flights = InFlight()
        self._controls = GenerationControls()  # pause_generation (sleep_pause.py)
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
        lock. Every method that takes parameters runs these checks (once: the returned
        params, passed on, are not checked again); call it to refuse a request before
        tokenizing its prompt. A ``structured_outputs`` constraint is compiled
        and probed under the grammar limits (``InvalidStructuredOutputError`` if refused); the
        returned copy carries the compiled grammar, which the request keeps until it ends
        (passing the returned params on skips compiling again).
        """
        return self._admission.check(params)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        stream: bool = False,
        lora_request: Lora = None,
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
        checked = self._admission.check(params)
        lora = self.loras.check(lora_request)
        tokenized = self._prompts.encode(prompt)
        with self._guard.held():
            self._check_open()
            sink = self._step_sink
            return self._enqueue(tokenized, checked, sink, streamed=stream, lora=lora).name

    def abort(self, request_id: str) -> bool:
        """Finish a request now with ``finish_reason="abort"`` and free its KV blocks.

        Works in any state and from any thread; the final output goes to whoever waits for
        the request (its stream, its ``generate`` call, or :meth:`step`). False if the
        request is unknown or already finished (on a dead engine every request is).
        ``request_id`` is a string (``RequestOutput.request_id``, what :meth:`add_request`
        returned); anything else raises ``TypeError``.
        """
        key = request_key(request_id)
        with self._guard.held():
            if self._dead is not None and not self._closed:
                return False
            self._check_open()
            self._catch_up()
            found = key is not None and self._outputs.abort(key)
            if found:
                self._guard.notify_all()
            return found

    def has_unfinished_requests(self) -> bool:
        """Whether any request (queued by any caller) has not finished yet."""
        with self._guard.held():
            if not self._closed:
                self._catch_up()
            return bool(self._table)

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
        with self._guard.held():
            self._check_open()
            steps_done = self._steps_done
            while self._stepping and self._steps_done == steps_done:
                self._guard.wait_for_change()
                self._check_open()
            if self._steps_done == steps_done:  # no step ended meanwhile: run one
                with contextlib.suppress(StepFailedError):  # reported through the sinks
                    self._step()
            self._guard.surface_interrupt()  # a held-back Ctrl-C, before delivery
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
            if self._controls.paused:
                return False
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
            self._guard.notify_all()

    def _step_ahead(self) -> bool:
        """:meth:`_step` with one step in flight (async scheduling): launch a step if none
        is in flight, plan and launch the next one before the oldest one's tokens are known
        (``Scheduler.schedule_ahead``), then wait for the oldest and record it. The worker
        thread runs the steps in launch order while this thread plans and records."""
        flights = self._flights
        scheduler = self.scheduler
        executor = self._executor
        assert executor is not None
        paused = self._controls.paused  # only the step in flight lands
        if not flights:
            if paused:
                return False
            plan = scheduler.schedule()
            if plan is None:
                return False
            flights.launch(executor, plan)
        if len(flights) == 1 and not self._table.structured and not paused:
            ahead = scheduler.schedule_ahead()
            if ahead is not None:
                flights.launch(executor, ahead)
        flight = flights.oldest
        try:
            with self._guard.released():
                output, seconds = flight.wait()
        except EngineClosedError:
            raise
        except Exception as error:
            # The step planned ahead read this one's tokens: it fails with it (its requests
            # too), and the next schedule() rolls both back (Scheduler.schedule_ahead).
            dropped = flights.drop()[1:]
            self._steps_done += 1
            self._fail_step(flight.plan, error, dropped)
        flights.landed()
        self._failures.succeeded()
        self._steps_done += 1
        self._record(flight.plan, output, seconds)
        return True

    def _execute(self, plan: BatchPlan) -> tuple[StepOutput, float]:
        assert self._executor is not None
        with self._guard.released():
            started = time.perf_counter()
            output = self._executor.execute(plan)
            return output, time.perf_counter() - started

    def _record(self, plan: BatchPlan, output: StepOutput, seconds: float) -> None:
        self._outputs.record(plan, output, seconds, self.speculation)

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
        failed = self._table.unfinished_in((plan, *dropped))
        self._outputs.fail(failed, error, dead=False)
        if not failed:  # every row was aborted while the step ran: nobody will raise this
            _logger.error(
                "a step failed after its requests were aborted; the engine goes on",
                exc_info=error,
            )
        names = tuple(request.name for request in sorted(failed, key=_request_id))
        raise StepFailedError(
            f"a step failed ({type(error).__name__}: {error}); its requests "
            f"{list(names)} were aborted and the engine goes on.",
            names,
        ) from error

    def _die(self, error: BaseException) -> NoReturn:
        """A fatal failure: end every unfinished request ("abort"), raise from now on."""
        self._dead = error
        self._outputs.fail(list(self._table.requests.values()), error, dead=True)
        self._guard.notify_all()
        raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        assert self._dead is not None
        return dead_engine_error(self._dead, self._failures)

    def _raise_failure(self, sink: OutputSink) -> None:
        """Raise what ended requests of ``sink`` (once), if a failed step or death did."""
        if sink.dead:
            raise self._dead_error()
        if sink.failed:
            ids, cause = tuple(sink.failed), sink.failure
            sink.failed = []
            raise failed_step_error(ids, cause) from cause

    def _catch_up(self) -> None:
        """Complete what an earlier call left undone: finish bookkeeping that raised
        halfway (``OutputProcessor.catch_up``), and abort dropped streams."""
        self._outputs.catch_up()
        while self._abandoned:
            self._outputs.abort(self._abandoned.popleft())

    # ----------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Lora | Sequence[Lora] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        ``prompts`` is one prompt or a list: strings, token-id lists, ``{"prompt": str}``,
        ``{"prompt_token_ids": [...]}`` or :class:`TokenizedPrompt` s. ``sampling_params`` is
        one ``SamplingParams`` for all or one per prompt. Every prompt is tokenized and
        validated (before the engine's lock is taken) before any is queued. Returns as soon
        as these requests are done (requests aborted meanwhile come back with
        ``finish_reason="abort"``); if it raises (Ctrl-C; ``StepFailedError`` when a step
        that held some of them failed; ``EngineDeadError``), its unfinished requests are
        aborted. ``lora_request``: an adapter for all prompts or one each (docs/lora.md).
        """
        return self._generate(parse_prompts(prompts), sampling_params, use_tqdm, lora_request)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        lora_request: Lora | Sequence[Lora] = None,
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
        return self._generate(list(rendered), sampling_params, use_tqdm, lora_request)

    def _generate(
        self,
        batch: list[PromptInput | TokenizedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora_request: object = None,
    ) -> list[RequestOutput]:
        # Parameters first (cheap refusals), then every prompt, all before the lock.
        params = self._admission.check_all(len(batch), sampling_params)
        loras = self.loras.per_prompt(lora_request, len(batch))
        prompts = [self._prompts.encode(prompt) for prompt in batch]
        sink = OutputSink(wants_progress=False)
        with self._guard.held():
            self._check_open()
            self._check_accepting()
            requests = self._admission.enqueue_all(
                self._table,
                self.scheduler,
                self.tokenizer,
                prompts,
                params,
                sink,
                abort=self._outputs.abort,
                loras=loras,
            )
            progress = ProgressBar(
                total=len(requests),
                enabled=use_tqdm,
                spec_decode=None if self.speculation is None else self.scheduler.stats,
            )

            def report_step() -> None:
                last_step = self._outputs.accounting.last_step
                progress.update(len(requests) - sink.num_unfinished, *last_step)

            try:
                self._drive(sink, lambda: sink.num_unfinished == 0, on_step=report_step)
            except BaseException:
                for request in requests:
                    self._outputs.abort(request.request_id)
                raise
            finally:
                progress.close()
            self._guard.surface_interrupt()  # a held-back Ctrl-C, before delivery
            return [request.output() for request in requests]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, lora_request: Lora = None
    ) -> RequestStream:
        """Queue one request and return an iterator over its deltas.

        Each delta is a :class:`RequestOutput` holding only what is new since the previous
        one: the completions that got tokens (their new tokens, text and logprobs) or just
        finished (with their finish reason); ``prompt_logprobs`` in the first delta only.
        The last has ``finished=True`` (finish reason ``"abort"`` if the request was
        aborted). Iterating steps the engine (or waits for the thread that does); other
        requests advance meanwhile. ``close()`` or dropping the iterator early aborts the
        request. If a step the request was in fails, iterating raises ``StepFailedError``.
        """
        checked = self._admission.check(params)
        lora = self.loras.check(lora_request)
        tokenized = self._prompts.encode(prompt)
        with self._guard.held():
            self._check_open()
            sink = OutputSink(wants_progress=True)
            request = self._enqueue(tokenized, checked, sink, streamed=True, lora=lora)
            return RequestStream(self, request)

    def _next_stream_delta(self, request: RequestState) -> RequestOutput:
        with self._guard.held():
            sink = request.sink
            self._drive(sink, lambda: bool(sink.updated))
            self._guard.surface_interrupt()  # a held-back Ctrl-C, before delivery
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
            if self._stepping or self._controls.paused:
                self._controls.check_not_pausing_thread()
                self._guard.wait_for_change()
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

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (blocks in use stay allocated)."""
        with self._guard.held():
            self._check_open()
            self.scheduler.reset_prefix_cache()  # the host KV tier's too

    # -------------------------------------------------------------------- close
    def close(self) -> None:
        """Release the model, the KV cache and any worker processes. Idempotent.

        A step running in another thread finishes first. Unfinished requests end with
        ``finish_reason="abort"``; their streams and ``generate`` calls return them.
        """
        with self._guard.held():
            if self._closed:
                return
            self._closed = True
            while self._stepping:
                self._guard.wait_for_change()
            for request_id in list(self._table.requests):
                self._outputs.abort(request_id)
            executor, self._executor = self._executor, None
            worker = self._flights.close()
            self._guard.notify_all()
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

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed; create a new Engine.")
        if self._dead is not None:
            raise self._dead_error()

    def _enqueue(
        self,
        prompt: TokenizedPrompt,
        params: SamplingParams,
        sink: OutputSink,
        *,
        streamed: bool = False,
        lora: LoRARequest | None = None,
    ) -> RequestState:
        self._check_accepting()
        table, scheduler, tokenizer = self._table, self.scheduler, self.tokenizer
        return self._admission.enqueue(
            table, scheduler, tokenizer, prompt, params, sink, streamed=streamed, lora=lora
        )


def _request_id(request: RequestState) -> int:
    return request.request_id
