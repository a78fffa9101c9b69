"""Admission: whether the engine can serve a request, then queueing it.

Two halves, on either side of the engine's lock. :meth:`Admission.check` is the one check of
sampling parameters (``Engine.check_sampling_params``; ``AsyncEngine`` and the server call
it through the engine): it takes no lock and reads only what is fixed once the engine is
built, so it runs in the caller's thread before anything is queued. Parameters it accepted
are remembered by identity (the latest few), so the same object passed on (the server to
``AsyncEngine.generate``, ``check_sampling_params`` to ``generate``) is not checked again.
:meth:`Admission.enqueue`, under the lock, turns a tokenized prompt and checked parameters
into a request: its sequences (one per completion) go to the scheduler, which validates them
before keeping anything, and its :class:`~pagedinfer.engine.requests.RequestState` into the
engine's :class:`~pagedinfer.engine.request_table.RequestTable`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import Any

from pagedinfer.adapters.sampling.grammar import GrammarCompiler
from pagedinfer.domain.forks import make_forks
from pagedinfer.domain.limits import RequestLimits
from pagedinfer.domain.lora import LoRARequest
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.scheduler import Scheduler
from pagedinfer.domain.sequence import Sequence as DomainSequence
from pagedinfer.engine.pooling_setup import POOLING_PARAMS, refuse_generation
from pagedinfer.engine.prompts import TokenizedPrompt
from pagedinfer.engine.request_table import RequestTable
from pagedinfer.engine.requests import CompletionState, OutputSink, RequestState
from pagedinfer.errors import InvalidRequestError, InvalidStructuredOutputError

__all__ = ["Admission"]

_logger = logging.getLogger("pagedinfer.engine.engine")

REMEMBERED = 256
"""How many accepted parameter objects :class:`Admission` remembers (the latest)."""


class Admission:
    """The checks a request passes before it is queued, and the queueing.

    ``limits`` are the engine's request limits; :attr:`limits` are them resolved
    (``max_n`` capped at ``max_running``, a ``max_logprobs`` of -1 is the vocabulary).
    ``defaults`` is what a request without parameters gets (``SamplingParams()`` if None).
    """

    def __init__(
        self,
        *,
        limits: RequestLimits,
        max_running: int,
        vocab_size: int,
        eos_token_ids: Collection[int],
        grammars: GrammarCompiler,
        speculative: bool,
        defaults: SamplingParams | None = None,
        pooling: bool = False,
    ) -> None:
        self.limits = dataclasses.replace(
            limits,
            max_n=min(limits.max_n, max_running),
            max_logprobs=limits.max_logprobs_for(vocab_size),
        )
        self._max_running = max_running
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._grammars = grammars
        self._speculative = speculative
        self._defaults = defaults if defaults is not None else SamplingParams()
        # Accepted parameters by id(); the values keep those ids from being reused.
        self._accepted: OrderedDict[int, SamplingParams] = OrderedDict()
        self._accepted_lock = threading.Lock()
        self._next_request_id = 0  # under the engine's lock
        self._pooling = pooling  # a pooling model: only its own requests (POOLING_PARAMS)

    # ------------------------------------------------------------------ checks
    def check(self, params: SamplingParams | None) -> SamplingParams:
        """``params`` (``None``: the engine's defaults, from the checkpoint's
        ``generation_config.json``) if the engine can serve them, else
        ``InvalidRequestError`` naming the field and the limit (see
        ``Engine.check_sampling_params``). Takes no lock."""
        if self._pooling and params is not POOLING_PARAMS:
            refuse_generation()
        if params is None:
            return self._defaults
        if self._was_accepted(params):
            return params
        checked = self._check(params)
        self._remember(checked)
        return checked

    def check_all(
        self,
        num_prompts: int,
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[SamplingParams]:
        """One checked ``SamplingParams`` per prompt: ``params`` for all, or one each."""
        if params is None or isinstance(params, SamplingParams):
            return [self.check(params)] * num_prompts
        if len(params) != num_prompts:  # before checking any of them
            raise InvalidRequestError(
                f"got {len(params)} SamplingParams for {num_prompts} prompts: pass "
                "one for all or exactly one per prompt."
            )
        return [self.check(each) for each in params]

    def _check(self, params: SamplingParams) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling params must be a SamplingParams, not {type(params).__name__}."
            )
        max_running = self._max_running
        if params.n > max_running:
            raise InvalidRequestError(
                f"SamplingParams.n={params.n} completions cannot run at once: at most "
                f"min(max_num_seqs, max_num_batched_tokens)={max_running} sequences run "
                "together. Lower n or raise max_num_seqs."
            )
        vocab_size = self._vocab_size
        self.limits.check(params, vocab_size=vocab_size)
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
                held.update(self._eos_token_ids)
            if held.issuperset(params.allowed_token_ids):
                raise InvalidRequestError(
                    "SamplingParams.allowed_token_ids holds only EOS / stop tokens, which "
                    "min_tokens holds back: nothing could be generated. Allow other tokens or "
                    "set min_tokens=0."
                )
        if params.structured_outputs is not None and self._speculative:
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

    def _was_accepted(self, params: SamplingParams) -> bool:
        with self._accepted_lock:
            return self._accepted.get(id(params)) is params

    def _remember(self, params: SamplingParams) -> None:
        with self._accepted_lock:
            accepted = self._accepted
            accepted[id(params)] = params
            accepted.move_to_end(id(params))
            while len(accepted) > REMEMBERED:
                accepted.popitem(last=False)

    # ---------------------------------------------------------------- queueing
    def enqueue(
        self,
        table: RequestTable,
        scheduler: Scheduler,
        tokenizer: Any,
        prompt: TokenizedPrompt,
        params: SamplingParams,
        sink: OutputSink,
        *,
        streamed: bool = False,
        lora: LoRARequest | None = None,
    ) -> RequestState:
        """Queue one request (``params`` checked by :meth:`check`, ``lora`` by the engine's
        LoRA registry); under the engine's lock. The scheduler validates it first: if it
        refuses, nothing is kept."""
        token_ids = prompt.token_ids
        request_id = self._next_request_id
        # One sequence per completion; the first shares the request's id and prefills the
        # prompt, the others fork from it (completion i is seeded completion_seed(seed, i)).
        seqs = [DomainSequence(request_id, token_ids, params, lora=lora)]
        seqs += make_forks(seqs[0])
        scheduler.add(seqs[0], forks=seqs[1:])  # validates; raises before anything is kept
        self._next_request_id += params.n
        request = RequestState(
            request_id,
            prompt.text,
            sink,
            eos_token_ids=self._eos_token_ids,
            num_prompt_tokens=len(token_ids),
            wants_prompt_logprobs=params.prompt_logprobs is not None,
        )
        for index, seq in enumerate(seqs):
            request.completions.append(
                CompletionState(request, seq, tokenizer, streamed=streamed, index=index)
            )
        table.add(request, structured=params.structured_outputs is not None)
        sink.num_unfinished += 1
        return request

    def enqueue_all(
        self,
        table: RequestTable,
        scheduler: Scheduler,
        tokenizer: Any,
        prompts: Sequence[TokenizedPrompt],
        params: Sequence[SamplingParams],
        sink: OutputSink,
        abort: Callable[[int], object],
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestState]:
        """Queue a checked batch: all of it, or (if the scheduler refuses one) none (the
        ones queued before are ended with ``abort``). ``loras``: each prompt's adapter."""
        requests: list[RequestState] = []
        adapters = [None] * len(prompts) if loras is None else loras
        try:
            for prompt, request_params, lora in zip(prompts, params, adapters, strict=True):
                requests.append(
                    self.enqueue(
                        table, scheduler, tokenizer, prompt, request_params, sink, lora=lora
                    )
                )
        except BaseException:
            for request in requests:
                abort(request.request_id)
            raise
        return requests
