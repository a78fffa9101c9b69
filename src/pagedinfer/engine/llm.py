"""``LLM``: vLLM's offline entry point (``vllm.LLM``) on pagedinfer's :class:`Engine`.

A vLLM script runs with ``from pagedinfer import LLM, SamplingParams`` in place of
``from vllm import ...``, and a local checkpoint directory as ``model``. ``LLM`` is an
:class:`Engine` (every Engine method works) whose constructor takes vLLM's arguments:

* those that map onto the Engine are passed on (``dtype``, ``max_model_len``,
  ``tensor_parallel_size``, ``block_size`` as ``kv_block_size``, ``speculative_config``, ...),
  and so are the Engine's own (``num_threads``, ``attention_backend``, ...);
* those that select something pagedinfer does not have (quantization, multimodal
  inputs, downloads, ...) are accepted at the value that means "off"
  and raise :class:`~pagedinfer.errors.ConfigurationError` naming the argument and why
  otherwise;
* those that only tune machinery pagedinfer does not have (``swap_space``,
  ``disable_log_stats``, ``trust_remote_code``, ...) are accepted and change nothing; each is
  listed with the reason in docs/api.md.

A keyword vLLM does not know either raises ``TypeError``, as for any Python function.
``generate`` and ``chat`` take vLLM's positional order; without ``sampling_params`` they use
the model's ``generation_config.json`` defaults as vLLM does (``generation_config="auto"``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedinfer.domain.beam_search import BeamSearchParams
from pagedinfer.domain.lora import LoRARequest
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.engine.beam_search import BeamSearchOutput, beam_search, tokenize_prompts
from pagedinfer.engine.config import ENGINE_OPTIONS
from pagedinfer.engine.cpu_notes import cpu_notes, explicit_options, keyword_spelling
from pagedinfer.engine.engine import Engine, Prompt
from pagedinfer.engine.llm_pooling import vllm_pooling_kwargs
from pagedinfer.engine.outputs import RequestOutput
from pagedinfer.engine.pooling import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingParams,
    PoolingTasks,
    ScoringRequestOutput,
)
from pagedinfer.errors import (
    ConfigurationError,
    InvalidRequestError,
)

__all__ = ["LLM", "VLLM_ARGUMENTS", "check_quantization"]

_logger = logging.getLogger(__name__)


def _is(*values: object) -> Callable[[Any], bool]:
    return lambda value: any(value is v or (value == v and type(value) is type(v)) for v in values)


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (Mapping, Sequence)) and not value)


def _anything(value: Any) -> bool:
    return True


def _flag(value: Any) -> bool:
    return value is None or isinstance(value, bool)


def _non_negative(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True, slots=True)
class _VllmArgument:
    """A vLLM argument the Engine has no equivalent for: the values accepted (changing
    nothing) and, for other values, why pagedinfer cannot honour them."""

    accepts: Callable[[Any], bool]
    why: str


_TEXT_ONLY = "pagedinfer generates text from text or token ids: no multimodal inputs"
# vLLM's quantization names for the formats pagedinfer loads, as config.json names them.
_QUANTIZATION_METHODS = {
    "fp8": "fp8",
    "compressed-tensors": "compressed-tensors",
    "awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
}
_LOCAL = (
    "pagedinfer loads a local directory and never downloads; fetch it with "
    "`hf download REPO --revision REV --local-dir DIR` and pass model=DIR"
)

VLLM_ARGUMENTS: dict[str, _VllmArgument] = {
    # Accepted whatever their value: they tune machinery pagedinfer does not have.
    "trust_remote_code": _VllmArgument(
        _flag, "pagedinfer never runs code from a checkpoint: its architectures are built in"
    ),
    "swap_space": _VllmArgument(
        _non_negative, "preempted sequences are recomputed, not swapped to CPU memory"
    ),
    "hf_token": _VllmArgument(_anything, "pagedinfer never downloads, so it needs no token"),
    "max_seq_len_to_capture": _VllmArgument(
        _anything, "CUDA graphs serve every length up to max_model_len"
    ),
    "disable_custom_all_reduce": _VllmArgument(
        _flag, "tensor-parallel ranks all-reduce with torch.distributed"
    ),
    "disable_async_output_proc": _VllmArgument(_flag, "outputs are processed in the step"),
    "disable_log_stats": _VllmArgument(_flag, "the engine logs no stats; stats() returns them"),
    "served_model_name": _VllmArgument(_anything, "only a server names its model"),
    "disable_sliding_window": _VllmArgument(
        _flag, "sliding-window layers always attend within their window"
    ),
    # Accepted only at the value that means "off".
    "allowed_local_media_path": _VllmArgument(_is(""), _TEXT_ONLY),
    "allowed_media_domains": _VllmArgument(_empty, _TEXT_ONLY),
    "mm_processor_kwargs": _VllmArgument(_empty, _TEXT_ONLY),
    "limit_mm_per_prompt": _VllmArgument(_empty, _TEXT_ONLY),
    "revision": _VllmArgument(_is(None), _LOCAL),
    "tokenizer_revision": _VllmArgument(_is(None), _LOCAL),
    "code_revision": _VllmArgument(_is(None), _LOCAL),
    "download_dir": _VllmArgument(_is(None), _LOCAL),
    "tokenizer_mode": _VllmArgument(
        _is("auto", "hf"), "tokenizers are loaded with transformers' AutoTokenizer ('auto')"
    ),
    "quantization": _VllmArgument(
        # A method name must also be the checkpoint's own (_check_quantization).
        lambda value: value is None or value in _QUANTIZATION_METHODS,
        "a quantized checkpoint is recognised from its config.json's quantization_config "
        "(fp8, compressed-tensors, awq, gptq: docs/models.md), so pass quantization=None; "
        "quantizing an unquantized checkpoint while it loads is not implemented (write a "
        "quantized copy with `pagedinfer quantize`)",
    ),
    "calculate_kv_scales": _VllmArgument(
        _flag,
        "FP8 KV-cache scales come from the checkpoint or are calibrated at start-up (see "
        "kv_cache_dtype), whatever this says",
    ),
    "load_format": _VllmArgument(
        _is("auto", "safetensors"), "pagedinfer reads *.safetensors weights only"
    ),
    "cpu_offload_gb": _VllmArgument(
        _is(0, 0.0), "weights are not offloaded: the model must fit on the device"
    ),
    "compilation_config": _VllmArgument(
        _empty, "the model is not torch.compile'd (CUDA graphs: see enforce_eager)"
    ),
    "logits_processors": _VllmArgument(_empty, "custom logits processors are not supported"),
    "structured_outputs_config": _VllmArgument(
        _empty,
        "structured outputs have one grammar engine (llguidance) and no engine-wide settings: "
        "constrain each request with SamplingParams(structured_outputs=...)",
    ),
    "guided_decoding_backend": _VllmArgument(
        lambda value: _empty(value) or _is("auto", "guidance")(value),
        "the one grammar engine is llguidance ('guidance'); constrain each request with "
        "SamplingParams(structured_outputs=...)",
    ),
    "enable_sleep_mode": _VllmArgument(
        _flag, "sleep() and wake_up() are always available (docs/sleep_mode.md)"
    ),
    "enable_chunked_prefill": _VllmArgument(
        _is(None, True),
        "prompts longer than max_num_batched_tokens are always prefilled in chunks; set "
        "max_num_batched_tokens >= max_model_len and none is",
    ),
    "data_parallel_size": _VllmArgument(
        _is(1), "one LLM is one engine: for data parallelism use pagedinfer.ray"
    ),
    "enable_expert_parallel": _VllmArgument(_is(False), "experts are split by tensor parallelism"),
}
"""vLLM arguments without an Engine equivalent, and what ``LLM`` does with each."""

# vLLM names of Engine arguments.
_RENAMED = {"block_size": "kv_block_size", "num_gpu_blocks_override": "num_kv_blocks"}
# vLLM's scheduling policies: first come, first served is what pagedinfer's "mixed" does.
_SCHEDULING_POLICIES = {"fcfs": "mixed", "mixed": "mixed", "prefill_first": "prefill_first"}
_ENGINE_ARGUMENTS = frozenset(ENGINE_OPTIONS)


class LLM(Engine):
    """vLLM's ``LLM``: ``LLM(model=DIR, ...)``, then ``generate``, ``chat``,
    ``get_tokenizer``. See the module docstring and docs/api.md for how each vLLM argument
    is treated; the Engine's own arguments are accepted too.

    ``seed=None`` is the engine seed 0 (vLLM's default). ``max_model_len=None`` is 4096, or
    the model's limit if lower (vLLM: the model's whole context; a CPU KV cache that long
    takes gigabytes), never silently below what was asked. ``generation_config="auto"``
    takes the default sampling parameters of ``generate`` and ``chat`` (when none are
    passed) from the model's ``generation_config.json``; ``"vllm"`` uses
    ``SamplingParams()``; a directory reads that directory's file.
    ``override_generation_config`` (a dict) is applied over them.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        tokenizer: str | os.PathLike[str] | None = None,
        skip_tokenizer_init: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        seed: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        generation_config: str = "auto",
        override_generation_config: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        engine_kwargs = _engine_kwargs(kwargs)
        model_path = os.fspath(model)
        check_quantization(model_path, kwargs.get("quantization"))
        super().__init__(
            model_path,
            tokenizer=tokenizer,
            skip_tokenizer_init=skip_tokenizer_init,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            seed=0 if seed is None else seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            generation_config=generation_config,
            override_generation_config=override_generation_config,
            **engine_kwargs,
        )
        self._tasks: PoolingTasks | None = None  # embed, classify, score (runner="pooling")
        given = {**engine_kwargs, "tensor_parallel_size": tensor_parallel_size, "dtype": dtype}
        given["gpu_memory_utilization"] = gpu_memory_utilization
        for note in cpu_notes(self.config, explicit_options(given), keyword_spelling):
            _logger.warning("LLM: %s", note)

    def get_tokenizer(self) -> Any:
        """The transformers tokenizer the engine uses (vLLM's ``get_tokenizer``)."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this LLM has no tokenizer (skip_tokenizer_init=True, or the checkpoint has "
                "no tokenizer files): pass tokenizer=DIR to load one."
            )
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without ``sampling_params``: the model's
        ``generation_config.json`` over ``SamplingParams()`` (``generation_config="auto"``)."""
        return self.default_sampling_params

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.generate``: outputs in input order. ``lora_request``: a LoRA adapter
        for every prompt or one per prompt (``enable_lora``; docs/lora.md); ``priority``
        None or all 0 (requests are served first come, first served)."""
        _check_request_options(priority=priority)
        return super().generate(prompts, sampling_params, use_tqdm, lora_request)

    # ------------------------------------------------------------------ pooling
    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: object = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed`` (``runner="pooling"``): one embedding per prompt, in input
        order (``outputs.embedding``); ``pooling_params.dimensions`` truncates (Matryoshka
        models); ``truncate_prompt_tokens`` keeps each prompt's last that many tokens.
        docs/pooling.md."""
        _check_request_options(lora_request=lora_request)
        tasks = self._pooling_tasks()
        return tasks.embed(
            tasks.truncated(prompts, truncate_prompt_tokens), pooling_params, use_tqdm
        )

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: object = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify``: the probabilities of a classifier's labels
        (``outputs.probs``), for a checkpoint with a classification head."""
        _check_request_options(lora_request=lora_request)
        tasks = self._pooling_tasks()
        prompts = tasks.truncated(prompts, truncate_prompt_tokens)
        return tasks.classify(prompts, pooling_params, use_tqdm)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: object = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: ``data_1`` (one query, or one per document) against each of
        ``data_2``; ``outputs.score`` is a cross-encoder's probability, or an embedder's
        cosine similarity."""
        _check_request_options(lora_request=lora_request)
        return self._pooling_tasks().score(data_1, data_2, use_tqdm, truncate_prompt_tokens)

    def _pooling_tasks(self) -> PoolingTasks:
        if self._tasks is None:  # a generating engine raises here, naming runner="pooling"
            self._tasks = PoolingTasks(self)
        return self._tasks

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: object = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the best ``params.beam_width`` sequences of each
        prompt, outputs in input order (docs/api.md, "Beam search"). Each step runs every
        live beam for one token through the engine together; the beams share their
        prompt's KV blocks through the prefix cache. ``use_tqdm``: a progress bar over the
        steps; ``concurrency_limit`` searches that many prompts at a time (``None``: all);
        ``lora_request`` must be None."""
        _check_request_options(lora_request=lora_request)
        if concurrency_limit is None:
            return beam_search(self, prompts, params, use_tqdm=use_tqdm)
        if (
            not isinstance(concurrency_limit, int)
            or isinstance(concurrency_limit, bool)
            or concurrency_limit < 1
        ):
            raise InvalidRequestError(
                f"concurrency_limit={concurrency_limit!r} is invalid: expected None (every "
                "prompt at once) or an integer >= 1."
            )
        # Every prompt is checked before the first search starts.
        batch = tokenize_prompts(self, prompts)
        outputs: list[BeamSearchOutput] = []
        for start in range(0, len(batch), concurrency_limit):
            chunk = batch[start : start + concurrency_limit]
            outputs += beam_search(self, chunk, params, use_tqdm=use_tqdm)
        return outputs

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat`` (its positional order): one conversation or a list of them,
        rendered by the chat template (``lora_request`` as :meth:`generate`'s). ``tools`` and
        ``mm_processor_kwargs`` must be None, ``continue_final_message`` False and
        ``chat_template_content_format`` ``"auto"`` or ``"string"``: anything else raises
        ``InvalidRequestError`` naming the argument."""
        refused = {
            "continue_final_message": (
                continue_final_message is not False,
                "a conversation is rendered with add_generation_prompt only",
            ),
            "tools": (not _empty(tools), "tool calling is not implemented"),
            "mm_processor_kwargs": (not _empty(mm_processor_kwargs), _TEXT_ONLY),
            "chat_template_content_format": (
                chat_template_content_format not in ("auto", "string"),
                "message contents reach the template as they are ('auto' or 'string')",
            ),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise InvalidRequestError(f"LLM.chat({name}=...) is not supported: {why}.")
        return super().chat(
            messages,
            sampling_params,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
        )


def _engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM keyword arguments as the Engine's: renamed, checked, or refused."""
    engine: dict[str, Any] = vllm_pooling_kwargs(kwargs)  # runner, pooler_config
    for name, value in kwargs.items():
        target = _RENAMED.get(name, name)
        if target in _ENGINE_ARGUMENTS:
            if target in engine:
                raise ConfigurationError(
                    f"LLM({name}=...) and LLM({target}=...) set the same thing: pass one."
                )
            engine[target] = value
            continue
        argument = VLLM_ARGUMENTS.get(name)
        if argument is None:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        if not argument.accepts(value):
            raise ConfigurationError(f"LLM({name}={value!r}) is not supported: {argument.why}.")
    if "enable_prefix_caching" in engine and engine["enable_prefix_caching"] is None:
        engine["enable_prefix_caching"] = True  # vLLM's None: the default
    if engine.get("distributed_executor_backend", "mp") is None:
        engine["distributed_executor_backend"] = "mp"  # vLLM's None: its choice, ours is mp
    policy = engine.get("scheduling_policy")
    if policy is not None:
        if policy not in _SCHEDULING_POLICIES:
            raise ConfigurationError(
                f"LLM(scheduling_policy={policy!r}) is not supported: requests are served "
                "first come, first served ('fcfs'; pagedinfer's 'mixed' or 'prefill_first')."
            )
        engine["scheduling_policy"] = _SCHEDULING_POLICIES[policy]
    return engine


def _check_request_options(*, lora_request: object = None, priority: object = None) -> None:
    if lora_request is not None:
        raise InvalidRequestError(
            "lora_request is not supported by beam_search (generate and chat take one)."
        )
    if priority is not None and (
        not isinstance(priority, Sequence) or any(p != 0 for p in priority)
    ):
        raise InvalidRequestError(
            f"priority={priority!r} is not supported: requests are served first come, first "
            "served (pass None or all 0)."
        )


def check_quantization(
    model_path: str, quantization: str | None, *, spelling: str | None = None
) -> None:
    """vLLM's ``quantization``: None, or the method the checkpoint's config.json names (its
    quantization_config is what pagedinfer loads by; vLLM's Marlin names count as theirs).
    ``spelling``: how the message names the argument (``LLM(quantization=...)``)."""
    if quantization is None:
        return
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return  # the engine reports a missing or broken config.json itself
    raw = config.get("quantization_config") if isinstance(config, dict) else None
    method = raw.get("quant_method") if isinstance(raw, dict) else None
    if isinstance(method, str) and method.lower() == _QUANTIZATION_METHODS[quantization]:
        return
    found = (
        f"names quant_method {method!r}"
        if method is not None
        else "has no quantization_config (an unquantized checkpoint)"
    )
    spelling = spelling or f"LLM(quantization={quantization!r})"
    raise ConfigurationError(
        f"{spelling} is not supported for this checkpoint: its "
        f"config.json {found}. A quantized checkpoint is recognised from its config.json's "
        "quantization_config, so pass quantization=None (or that method's name); quantizing "
        "an unquantized checkpoint while it loads is not implemented: write a quantized copy "
        "with `pagedinfer quantize DIR OUT --method fp8` (docs/models.md)."
    )
