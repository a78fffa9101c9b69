"""``Engine``: the public entry point. Tokenize, schedule, run, sample, detokenize, repeat.

One step reads top to bottom in :meth:`Engine.step`: the scheduler plans, the executor runs
the plan and samples, the scheduler records the samples; the engine then detokenizes, checks
stop strings and reports. Requests are validated completely before anything is queued, so a
rejected request leaves the engine exactly as it was.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedinfer.adapters.attention import resolve_backend_name
from pagedinfer.adapters.executor import Executor, create_executor
from pagedinfer.adapters.models.registry import read_model_config
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.scheduler import Scheduler, SchedulerConfig
from pagedinfer.domain.sequence import FinishReason
from pagedinfer.domain.sequence import Sequence as DomainSequence
from pagedinfer.engine.config import EngineConfig, resolve_device, resolve_dtype
from pagedinfer.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pagedinfer.engine.outputs import RequestOutput, StreamDelta
from pagedinfer.engine.progress import ProgressBar
from pagedinfer.errors import EngineClosedError, InvalidRequestError

__all__ = ["Engine", "EngineStats"]

Prompt = str | Sequence[int]

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)


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


class _Request:
    """The engine's bookkeeping for one request (the scheduler owns the Sequence state).

    Requests with stop strings, and streamed requests, are detokenized incrementally every
    step; the others are decoded once, when they finish.
    """

    __slots__ = (
        "detokenizer",
        "emitted_chars",
        "emitted_tokens",
        "holdback",
        "prompt",
        "seq",
        "stop_matcher",
        "stopped_by_string",
    )

    def __init__(
        self, seq: DomainSequence, prompt: str | None, tokenizer: Any, *, streamed: bool
    ) -> None:
        self.seq = seq
        self.prompt = prompt
        stop = seq.params.stop
        incremental = tokenizer is not None and (streamed or bool(stop))
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, seq.prompt_token_ids) if incremental else None
        )
        self.stop_matcher = StopStringMatcher(stop) if incremental else None
        self.stopped_by_string = False
        # A streamed delta holds back text that could still turn out to start a stop string.
        self.holdback = max((len(text) for text in stop), default=1) - 1
        self.emitted_tokens = 0
        self.emitted_chars = 0


class Engine:
    """Offline LLM inference on a paged KV cache.

    ``Engine(model_path)`` loads a local Hugging Face checkpoint directory (``config.json`` +
    safetensors; tokenizer files optional). ``device="auto"`` uses CUDA when available;
    ``dtype="auto"`` follows the checkpoint on CUDA and uses float32 on the CPU. The KV cache
    has ``num_kv_blocks`` blocks of ``kv_block_size`` tokens, or is sized from free memory
    (``gpu_memory_utilization`` of the GPU, a fraction of free RAM on the CPU).
    ``attention_backend`` is ``"auto"``, ``"torch"``, ``"triton"`` or ``"flash"``.
    Unknown keyword arguments raise ``TypeError``.
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
    ) -> None:
        self._executor: Executor | None = None
        self._closed = True  # until construction succeeds
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
        )
        self.tokenizer = _load_tokenizer(config.model_path)
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
                )
            )
        except BaseException:
            executor.close()
            raise
        self._executor = executor
        self._closed = False
        self._requests: dict[int, _Request] = {}
        self._deferred: list[RequestOutput] = []
        self._next_request_id = 0
        self._num_finished = 0
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._prefill_seconds = 0.0
        self._decode_seconds = 0.0
        self._last_step = (False, 0, 0.0)  # (is_prefill, tokens, seconds) of the latest step

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Queue one request and return its id. Raises ``ValueError`` for bad input."""
        self._check_open()
        token_ids, text = self._encode(prompt)
        return self._enqueue(token_ids, text, self._check_params(params))

    def abort(self, request_id: int) -> bool:
        """Stop a request and free its KV blocks. False if it is unknown or already done."""
        self._check_open()
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request_id)
        self._num_finished += 1
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the requests that progressed or finished.

        Outputs of requests that finished while :meth:`generate` or :meth:`stream` drove the
        engine for other requests are delivered by the next call.
        """
        self._check_open()
        outputs, self._deferred = self._deferred, []
        outputs.extend(self._step())
        return outputs

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan is None:
            if self.scheduler.has_unfinished():  # cannot happen with an engine-owned pool
                raise RuntimeError("the scheduler could not schedule any unfinished request")
            return []
        assert self._executor is not None
        started = time.perf_counter()
        sampled = self._executor.execute(plan)
        seconds = time.perf_counter() - started
        if plan.is_prefill:
            self._prompt_tokens += plan.num_tokens
            self._prefill_seconds += seconds
        else:
            self._decode_seconds += seconds
        self._generated_tokens += len(sampled)
        self._last_step = (plan.is_prefill, plan.num_tokens, seconds)
        outputs = []
        for seq in self.scheduler.postprocess(plan, sampled):
            request = self._requests[seq.seq_id]
            self._check_stop_strings(request)
            outputs.append(self._output(request))
            if seq.is_finished:
                del self._requests[seq.seq_id]
                self._num_finished += 1
        return outputs

    def _check_stop_strings(self, request: _Request) -> None:
        if request.detokenizer is None or request.stop_matcher is None:
            return
        seq = request.seq
        delta = request.detokenizer.append([seq.last_token_id])
        if not request.stop_matcher.feed(delta):
            return
        request.stopped_by_string = True
        if seq.is_finished:  # finished by length in the same step: the stop string wins
            seq.finish_reason = FinishReason.STOP
        else:
            self.scheduler.finish(seq.seq_id, FinishReason.STOP)

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
        Every prompt is validated before any is queued.
        """
        self._check_open()
        batch = _as_prompt_list(prompts)
        params = self._params_for(batch, sampling_params)
        encoded = [self._encode(prompt) for prompt in batch]
        ids = [
            self._enqueue(tokens, text, p)
            for (tokens, text), p in zip(encoded, params, strict=True)
        ]
        pending = set(ids)
        results: dict[int, RequestOutput] = {}
        progress = ProgressBar(total=len(ids), enabled=use_tqdm)
        try:
            while pending:
                for output in self._step():
                    if output.request_id in pending and output.finished:
                        pending.discard(output.request_id)
                        results[output.request_id] = output
                        progress.advance()
                    elif output.finished:
                        self._deferred.append(output)
                is_prefill, tokens, seconds = self._last_step
                progress.report_step(is_prefill, tokens, seconds)
        except BaseException:
            for request_id in pending:
                self.abort(request_id)
            raise
        finally:
            progress.close()
        return [results[request_id] for request_id in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield the new tokens (and text) of one request after every step that adds some.

        Other queued requests advance meanwhile; their final outputs are returned by the next
        :meth:`step`. Closing the iterator early aborts the request.
        """
        self._check_open()
        token_ids, text = self._encode(prompt)
        request_id = self._enqueue(token_ids, text, self._check_params(params), streamed=True)
        request = self._requests[request_id]
        finished = False
        try:
            while not finished:
                for output in self._step():
                    if output.request_id != request_id:
                        if output.finished:
                            self._deferred.append(output)
                        continue
                    finished = output.finished
                    yield self._stream_delta(request, output)
        finally:
            if not finished and not self._closed:
                self.abort(request_id)

    # -------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        self._check_open()
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
        self._check_open()
        self.scheduler.pool.reset_prefix_cache()

    # -------------------------------------------------------------------- close
    def close(self) -> None:
        """Release the model, the KV cache and any worker processes. Idempotent."""
        if self._closed:
            return
        self._closed = True
        executor, self._executor = self._executor, None
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
        *,
        streamed: bool = False,
    ) -> int:
        request_id = self._next_request_id
        seq = DomainSequence(request_id, token_ids, params)
        self.scheduler.add(seq)  # validates again; raises before anything is recorded
        self._next_request_id += 1
        self._requests[request_id] = _Request(seq, text, self.tokenizer, streamed=streamed)
        return request_id

    def _output(self, request: _Request) -> RequestOutput:
        seq = request.seq
        finished = seq.is_finished
        if self.tokenizer is None:
            text = ""
        elif request.stopped_by_string and request.stop_matcher is not None:
            text = request.stop_matcher.text
        elif finished:
            text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True)
        elif request.stop_matcher is not None:
            text = request.stop_matcher.text
        else:
            text = ""  # decoded once the request finishes
        reason = seq.finish_reason
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=request.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.completion_token_ids,
            text=text,
            finished=finished,
            finish_reason=reason.value if reason is not None else None,
            num_cached_tokens=seq.num_cached_tokens,
        )

    @staticmethod
    def _stream_delta(request: _Request, output: RequestOutput) -> StreamDelta:
        tokens = output.token_ids[request.emitted_tokens :]
        request.emitted_tokens = len(output.token_ids)
        text = output.text
        end = len(text) if output.finished else max(len(text) - request.holdback, 0)
        end = max(end, request.emitted_chars)
        delta_text = text[request.emitted_chars : end]
        request.emitted_chars = end
        return StreamDelta(
            request_id=output.request_id,
            token_ids=tokens,
            text=delta_text,
            finished=output.finished,
            finish_reason=output.finish_reason,
        )


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


def _load_tokenizer(model_path: str) -> Any:
    directory = Path(model_path)
    if not any((directory / name).exists() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0
