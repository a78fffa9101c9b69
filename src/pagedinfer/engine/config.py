"""The engine's settings: validated at construction, device and dtype resolved."""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TypedDict

import torch

from pagedinfer.adapters.kv_cache import KV_CACHE_DTYPES
from pagedinfer.adapters.models.finite import WEIGHT_CHECKS, WeightCheck, validate_weight_check
from pagedinfer.adapters.sampling.logprobs_mode import (
    LOGPROBS_MODES,
    LogprobsMode,
    validate_logprobs_mode,
)
from pagedinfer.domain.grammar_limits import (
    DEFAULT_GRAMMAR_LIMITS,
    GRAMMAR_LIMIT_HELP,
    GrammarLimits,
)
from pagedinfer.domain.limits import (
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_N,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MAX_STOP,
    DEFAULT_MAX_STOP_STR_LEN,
    RequestLimits,
    max_running,
)
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.scheduler import SCHEDULING_POLICIES, SchedulingPolicy
from pagedinfer.domain.speculative import SpeculativeConfig
from pagedinfer.engine.cli_flag import (
    CLI_FLAG,
    GRAMMAR_LIMITS_GROUP,
    SPECULATIVE_EXAMPLE,
    CliFlag,
    one_of,
    parse_num_threads,
    parse_speculative_config,
)
from pagedinfer.engine.device_dtype import resolve_device, resolve_dtype
from pagedinfer.engine.generation_config import (
    check_generation_config,
    generation_defaults,
    parse_override_generation_config,
)
from pagedinfer.engine.kv_offloading import check_kv_offloading
from pagedinfer.engine.lora_options import LORA_OPTION_NAMES, check_lora_options, lora_flag
from pagedinfer.engine.pooling_setup import (
    POOLER_HELP,
    RUNNER_HELP,
    RUNNERS,
    PoolerConfig,
    parse_pooler_config,
)
from pagedinfer.engine.threads import available_cpus, default_num_threads, resolve_num_threads
from pagedinfer.errors import ConfigurationError

__all__ = [
    "ATTENTION_BACKENDS",
    "CLI_FLAG",
    "DEFAULT_MAX_MODEL_LEN",
    "DISTRIBUTED_EXECUTOR_BACKENDS",
    "ENGINE_OPTIONS",
    "GRAMMAR_LIMITS_GROUP",
    "KV_CACHE_DTYPES",
    "SCHEDULING_POLICIES",
    "CliFlag",
    "EngineConfig",
    "EngineOptions",
    "available_cpus",
    "default_num_threads",
    "engine_signature",
    "parse_num_threads",
    "parse_speculative_config",
    "resolve_async_scheduling",
    "resolve_device",
    "resolve_dtype",
    "resolve_max_model_len",
    "resolve_num_threads",
]

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash")
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """``Engine``'s keyword arguments, checked. See :class:`pagedinfer.Engine` for meanings.

    Every field but ``model_path`` is an engine option, declared once here: its default,
    and (in its metadata, :class:`CliFlag`) its command-line flag and help text, from which
    the command line builds its flags (``pagedinfer.cli``).
    """

    model_path: str
    device: str | torch.device = field(
        default="auto", metadata={CLI_FLAG: CliFlag("auto, cpu, cuda or cuda:N", metavar="DEVICE")}
    )
    dtype: str | torch.dtype = field(
        default="auto", metadata={CLI_FLAG: CliFlag("auto, float32, float16 or bfloat16")}
    )
    max_model_len: int | None = field(
        default=None,
        metadata={
            CLI_FLAG: CliFlag(
                "most tokens (prompt + output) per request; beyond the model's limit is an error "
                f"(default: {DEFAULT_MAX_MODEL_LEN}, or the model's limit if lower)",
                metavar="N",
                parse=int,
            )
        },
    )
    max_num_seqs: int = field(
        default=DEFAULT_MAX_NUM_SEQS,
        metadata={CLI_FLAG: CliFlag("most requests running at once", metavar="N")},
    )
    max_num_batched_tokens: int = field(
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        metadata={CLI_FLAG: CliFlag("token budget of one step", metavar="N")},
    )
    kv_block_size: int = field(
        default=256,
        metadata={
            CLI_FLAG: CliFlag("tokens per KV-cache block", aliases=("--block-size",), metavar="N")
        },
    )
    num_kv_blocks: int | None = field(
        default=None,
        metadata={
            CLI_FLAG: CliFlag(
                "KV-cache size in blocks (default: sized)",
                aliases=("--num-gpu-blocks-override",),
                metavar="N",
                parse=int,
            )
        },
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata={CLI_FLAG: CliFlag("share of GPU memory to use", metavar="X")}
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            CLI_FLAG: CliFlag("ranks to split the model across", aliases=("-tp",), metavar="N")
        },
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata={
            CLI_FLAG: CliFlag(
                "stages to split the decoder layers into (needs "
                "--distributed-executor-backend ray)",
                aliases=("-pp",),
                metavar="N",
            )
        },
    )
    distributed_executor_backend: str = field(
        default="mp",
        metadata={
            CLI_FLAG: CliFlag(
                "mp: worker processes on this machine; ray: Ray actors on the cluster this "
                "process connects to (RAY_ADDRESS, or a local one), across nodes (docs/scaling.md)",
                choices=DISTRIBUTED_EXECUTOR_BACKENDS,
            )
        },
    )
    attention_backend: str = field(
        default="auto",
        metadata={CLI_FLAG: CliFlag(one_of(ATTENTION_BACKENDS), metavar="NAME")},
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            CLI_FLAG: CliFlag(
                "KV-cache element type: auto (the model's dtype) or FP8, which holds twice the "
                "tokens of a 16-bit cache (fp8 is fp8_e4m3; not with the flash backend)",
                choices=KV_CACHE_DTYPES,
            )
        },
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata={
            CLI_FLAG: CliFlag(
                "KV-cache size in bytes (default: sized from the configuration and memory)",
                metavar="N",
                parse=int,
            )
        },
    )
    # "auto": default_num_threads(); None: leave torch's setting (one thread per core) alone
    num_threads: int | str | None = field(
        default="auto",
        metadata={
            CLI_FLAG: CliFlag(
                "torch CPU threads; auto: half the CPUs this process may use, which does not "
                "collapse when other work shares the cores (docs/api.md)",
                metavar="N",
                parse=parse_num_threads,
            )
        },
    )
    tokenizer: str | os.PathLike[str] | None = field(
        default=None,
        metadata={
            CLI_FLAG: CliFlag(
                "directory to load the tokenizer from (default: the model directory)",
                metavar="DIR",
                parse=str,
            )
        },
    )
    skip_tokenizer_init: bool = field(
        default=False,
        metadata={
            CLI_FLAG: CliFlag(
                "load no tokenizer: token-id prompts only, no output text", switch=True
            )
        },
    )
    worker_timeout_s: float = field(
        default=120.0,
        metadata={
            CLI_FLAG: CliFlag(
                "how long a stalled tensor-parallel worker may hold up a step", metavar="X"
            )
        },
    )
    enforce_eager: bool = field(
        default=False, metadata={CLI_FLAG: CliFlag("no CUDA graphs", switch=True)}
    )
    batch_invariant: bool = field(
        default=False,
        metadata={
            CLI_FLAG: CliFlag(
                "a request's tokens and logprobs bitwise the same whatever shares its batch "
                "(fixed reduction splits; slower: docs/sleep_mode.md)",
                switch=True,
            )
        },
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={
            CLI_FLAG: CliFlag(
                "share the KV blocks of common prompt prefixes between requests (on by default)",
                switch=True,
            )
        },
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata={
            CLI_FLAG: CliFlag(
                "plan each step while the previous one runs (one step in flight); default: "
                "where measured faster (docs/api.md)",
                switch=True,
            )
        },
    )
    # Speculative decoding: vLLM's dict ({"method": "ngram", ...}) or the checked config.
    speculative_config: SpeculativeConfig | Mapping[str, object] | None = field(
        default=None,
        metadata={
            CLI_FLAG: CliFlag(
                f"speculative decoding, vLLM's JSON, e.g. '{SPECULATIVE_EXAMPLE}' (also "
                "prompt_lookup_max, prompt_lookup_min; docs/api.md); default: off",
                aliases=("--speculative_config",),
                metavar="JSON",
                parse=parse_speculative_config,
            )
        },
    )
    scheduling_policy: SchedulingPolicy = field(
        default="mixed",
        metadata={
            CLI_FLAG: CliFlag(
                "mixed: prompt chunks ride along with decode tokens in one step; "
                "prefill_first: prefill steps before decode steps",
                choices=SCHEDULING_POLICIES,
            )
        },
    )
    seed: int = field(
        default=0, metadata={CLI_FLAG: CliFlag("sampler seed of unseeded requests", metavar="N")}
    )
    # The checkpoint's generation_config.json as the default sampling fields of requests that
    # do not set them (engine/generation_config.py), as vLLM reads it.
    generation_config: str | os.PathLike[str] = field(
        default="auto",
        metadata={
            CLI_FLAG: CliFlag(
                "default sampling fields of requests that leave them out: auto: the model's "
                "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                "max_new_tokens as max_tokens), as vLLM; vllm: ignore it; DIR: that directory's",
                metavar="auto|vllm|DIR",
                parse=str,
            )
        },
    )
    override_generation_config: Mapping[str, object] | None = field(
        default=None,
        metadata={
            CLI_FLAG: CliFlag(
                "JSON object of sampling fields applied over --generation-config's, e.g. "
                "'{\"temperature\": 0.6}' (default: none)",
                metavar="JSON",
                parse=parse_override_generation_config,
            )
        },
    )
    max_n: int = field(
        default=DEFAULT_MAX_N,
        metadata={
            CLI_FLAG: CliFlag(
                "most completions (n) per request", group="request limits", metavar="N"
            )
        },
    )
    max_logprobs: int = field(
        default=DEFAULT_MAX_LOGPROBS,
        metadata={
            CLI_FLAG: CliFlag(
                "most top logprobs per token (logprobs, prompt_logprobs); -1: the vocabulary",
                group="request limits",
                metavar="N",
            )
        },
    )
    max_stop: int = field(
        default=DEFAULT_MAX_STOP,
        metadata={
            CLI_FLAG: CliFlag("most stop strings per request", group="request limits", metavar="N")
        },
    )
    max_stop_str_len: int = field(
        default=DEFAULT_MAX_STOP_STR_LEN,
        metadata={
            CLI_FLAG: CliFlag(
                "most characters per stop string", group="request limits", metavar="N"
            )
        },
    )
    max_consecutive_failed_steps: int = field(
        default=3,
        metadata={
            CLI_FLAG: CliFlag(
                "failed steps in a row after which the engine is dead (each fails its requests)",
                group="request limits",
                metavar="N",
            )
        },
    )

    weight_check: WeightCheck = field(
        default="default",
        metadata={
            CLI_FLAG: CliFlag(
                "tensors that must be finite at load: default (scales, norms, biases), all "
                "(every tensor; slower load) or none (docs/models.md)",
                choices=WEIGHT_CHECKS,
            )
        },
    )
    logprobs_mode: LogprobsMode = field(
        default="raw_logprobs",
        metadata={
            CLI_FLAG: CliFlag(
                "what logprobs report: raw_* the model's distribution, processed_* the "
                "sampler's (after penalties, temperature, top-k/top-p); *_logits the values "
                "before log_softmax (docs/api.md)",
                choices=LOGPROBS_MODES,
            )
        },
    )
    # Pooling models (docs/pooling.md; checked in engine/pooling_setup.py).
    runner: str = field(default="auto", metadata={CLI_FLAG: CliFlag(RUNNER_HELP, choices=RUNNERS)})
    pooler_config: PoolerConfig | Mapping[str, object] | None = field(
        default=None,
        metadata={CLI_FLAG: CliFlag(POOLER_HELP, metavar="JSON", parse=parse_pooler_config)},
    )
    # LoRA (docs/lora.md; flags and checks in engine/lora_options.py).
    enable_lora: bool = field(default=False, metadata={CLI_FLAG: lora_flag("enable_lora")})
    max_loras: int = field(default=1, metadata={CLI_FLAG: lora_flag("max_loras")})
    max_lora_rank: int = field(default=16, metadata={CLI_FLAG: lora_flag("max_lora_rank")})
    max_cpu_loras: int | None = field(default=None, metadata={CLI_FLAG: lora_flag("max_cpu_loras")})
    kv_offloading_size: float | None = field(
        default=None,
        metadata={
            CLI_FLAG: CliFlag("host KV tier in GiB (default: none)", metavar="GIB", parse=float)
        },
    )
    kv_offloading_backend: str | None = field(
        default=None,
        metadata={
            CLI_FLAG: CliFlag("host KV tier kind (default: native)", choices=("native",), parse=str)
        },
    )
    # Structured outputs: what one constraint may cost (domain/grammar_limits.py); one
    # --grammar-<name> flag per limit.
    grammar_limits: GrammarLimits = field(
        default=DEFAULT_GRAMMAR_LIMITS,
        metadata={
            CLI_FLAG: CliFlag(
                "what one structured-output constraint may cost (docs/structured-outputs.md)",
                group=GRAMMAR_LIMITS_GROUP,
                members=GRAMMAR_LIMIT_HELP,
                member_prefix="grammar",
            )
        },
    )

    @classmethod
    def from_options(cls, model: str | os.PathLike[str], options: EngineOptions) -> EngineConfig:
        """``Engine(model, **options)``'s configuration, checked (``TypeError`` for a
        keyword that is no engine option, as a function's own would be)."""
        unknown = sorted(set(options) - set(ENGINE_OPTIONS))
        if unknown:
            raise TypeError(
                f"Engine() got an unexpected keyword argument {unknown[0]!r}: the engine's "
                f"options are {', '.join(ENGINE_OPTIONS)} (docs/api.md)."
            )
        return cls(model_path=os.fspath(model), **options)

    @property
    def max_running(self) -> int:
        """The most sequences that run at once: ``min(max_num_seqs, max_num_batched_tokens)``."""
        return max_running(self.max_num_seqs, self.max_num_batched_tokens)

    @property
    def speculation(self) -> SpeculativeConfig | None:
        """``speculative_config``, checked (``None``: no speculative decoding)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_value(self.speculative_config)

    def default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of a request that sets none: ``SamplingParams()`` with
        the fields ``generation_config`` gives (reads the file; ``ConfigurationError`` or
        ``UnsupportedModelError`` naming it when it is invalid)."""
        return SamplingParams(
            **generation_defaults(
                self.model_path, self.generation_config, self.override_generation_config
            )
        )

    @property
    def request_limits(self) -> RequestLimits:
        """The request limits as configured (``max_logprobs=-1`` not resolved yet)."""
        return RequestLimits(
            max_n=self.max_n,
            max_logprobs=self.max_logprobs,
            max_stop=self.max_stop,
            max_stop_str_len=self.max_stop_str_len,
        )

    def __post_init__(self) -> None:
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len, minimum=2)
        _positive_int("kv_block_size", self.kv_block_size)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ConfigurationError(
                f"distributed_executor_backend={self.distributed_executor_backend!r} is "
                "invalid: expected 'mp' (worker processes on this machine, the default) or "
                "'ray' (Ray actors, on one or several nodes)."
            )
        if self.pipeline_parallel_size > 1 and self.distributed_executor_backend != "ray":
            raise ConfigurationError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} needs "
                "distributed_executor_backend='ray' (the 'mp' executor runs tensor "
                "parallelism only): pass distributed_executor_backend='ray'."
            )
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory_bytes is not None:
            _positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
            if self.num_kv_blocks is not None:
                raise ConfigurationError(
                    f"num_kv_blocks={self.num_kv_blocks} and kv_cache_memory_bytes="
                    f"{self.kv_cache_memory_bytes} both size the KV cache: pass only one."
                )
        if self.num_threads is not None and self.num_threads != "auto":
            if not isinstance(self.num_threads, int) or isinstance(self.num_threads, bool):
                raise ConfigurationError(
                    f"num_threads={self.num_threads!r} is invalid: expected an integer >= 1, "
                    "'auto' or None."
                )
            _positive_int("num_threads", self.num_threads)
        _positive_int("max_consecutive_failed_steps", self.max_consecutive_failed_steps)
        validate_weight_check(self.weight_check)
        validate_logprobs_mode(self.logprobs_mode)
        check_lora_options(**{name: getattr(self, name) for name in LORA_OPTION_NAMES})
        check_kv_offloading(self)
        self.request_limits  # noqa: B018 (validates the limits: ConfigurationError)
        if not isinstance(self.grammar_limits, GrammarLimits):
            raise ConfigurationError(
                f"grammar_limits={self.grammar_limits!r} is invalid: expected a GrammarLimits "
                "(pagedinfer.GrammarLimits(max_chars=..., step_lexer_fuel=..., ...))."
            )
        timeout = self.worker_timeout_s
        if (
            not isinstance(timeout, (int, float))
            or isinstance(timeout, bool)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ConfigurationError(
                f"worker_timeout_s={timeout!r} is invalid: expected a number of seconds > 0."
            )
        utilization = self.gpu_memory_utilization
        if (
            not isinstance(utilization, (int, float))
            or isinstance(utilization, bool)
            or not math.isfinite(utilization)
            or not 0.0 < utilization <= 1.0
        ):
            raise ConfigurationError(
                f"gpu_memory_utilization={utilization!r} is invalid: expected a fraction in (0, 1]."
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigurationError(
                f"attention_backend={self.attention_backend!r} is unknown: choose one of "
                f"{', '.join(ATTENTION_BACKENDS)}."
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigurationError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is unknown: choose one of "
                f"{', '.join(KV_CACHE_DTYPES)} ('fp8' is fp8_e4m3, as in vLLM)."
            )
        for name in (
            "enforce_eager",
            "batch_invariant",
            "enable_prefix_caching",
            "skip_tokenizer_init",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{name}={getattr(self, name)!r} must be True or False.")
        if self.skip_tokenizer_init and self.tokenizer is not None:
            raise ConfigurationError(
                f"tokenizer={self.tokenizer!r} and skip_tokenizer_init=True contradict each "
                "other: pass one of them."
            )
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ConfigurationError(
                f"async_scheduling={self.async_scheduling!r} must be True, False or None "
                "(None: the default for the device)."
            )
        if self.async_scheduling and self.pipeline_parallel_size > 1:
            raise ConfigurationError(
                f"async_scheduling=True cannot run with pipeline_parallel_size="
                f"{self.pipeline_parallel_size}: the stages already overlap steps. Pass "
                "async_scheduling=False (or leave it out)."
            )
        speculation = self.speculation  # ConfigurationError if malformed
        if speculation is not None and self.async_scheduling:
            raise ConfigurationError(
                "speculative_config cannot run with async_scheduling=True: a step's drafts "
                "follow the previous step's tokens, so no step can be planned ahead of them. "
                "Drop one of the two."
            )
        if (
            speculation is not None
            and speculation.method == "draft_model"
            and self.tensor_parallel_size > 1
        ):
            raise ConfigurationError(
                f"speculative_config method='draft_model' runs with tensor_parallel_size=1 "
                f"only (got {self.tensor_parallel_size}; not implemented): use method "
                "'ngram', or one rank."
            )
        if speculation is not None and self.pipeline_parallel_size > 1:
            raise ConfigurationError(
                f"speculative_config cannot run with pipeline_parallel_size="
                f"{self.pipeline_parallel_size} (not implemented): use tensor parallelism, "
                "or drop speculative_config."
            )
        check_generation_config(self.generation_config, self.override_generation_config)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigurationError(f"seed={self.seed!r} must be an integer.")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigurationError(
                f"scheduling_policy={self.scheduling_policy!r} is unknown: choose one of "
                f"{', '.join(SCHEDULING_POLICIES)}."
            )


class EngineOptions(TypedDict, total=False):
    """``Engine``'s keyword arguments (``Engine(model, **options)``): :class:`EngineConfig`'s
    fields but ``model_path``, for type checkers; the defaults and meanings are the config's
    (a test checks that the names are the same)."""

    device: str | torch.device
    dtype: str | torch.dtype
    max_model_len: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_block_size: int
    num_kv_blocks: int | None
    gpu_memory_utilization: float
    tensor_parallel_size: int
    pipeline_parallel_size: int
    distributed_executor_backend: str
    attention_backend: str
    kv_cache_dtype: str
    kv_cache_memory_bytes: int | None
    num_threads: int | str | None
    tokenizer: str | os.PathLike[str] | None
    skip_tokenizer_init: bool
    worker_timeout_s: float
    enforce_eager: bool
    batch_invariant: bool
    enable_prefix_caching: bool
    async_scheduling: bool | None
    speculative_config: SpeculativeConfig | Mapping[str, object] | None
    scheduling_policy: SchedulingPolicy
    seed: int
    generation_config: str | os.PathLike[str]
    override_generation_config: Mapping[str, object] | None
    max_n: int
    max_logprobs: int
    max_stop: int
    max_stop_str_len: int
    max_consecutive_failed_steps: int
    weight_check: WeightCheck
    logprobs_mode: LogprobsMode
    runner: str
    pooler_config: PoolerConfig | Mapping[str, object] | None
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None
    kv_offloading_size: float | None
    kv_offloading_backend: str | None
    grammar_limits: GrammarLimits


ENGINE_OPTIONS: tuple[str, ...] = tuple(
    option.name for option in fields(EngineConfig) if CLI_FLAG in option.metadata
)
"""The names of the engine's options (``Engine``'s keywords), in declaration order."""


def engine_signature() -> inspect.Signature:
    """``Engine.__init__``'s signature as ``help()`` and ``inspect`` show it: ``model``, then
    every option, keyword-only, with its default (``Engine(model, **options)`` in the code)."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    keyword = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature(
        [
            inspect.Parameter("self", positional),
            inspect.Parameter("model", positional, annotation="str | os.PathLike[str]"),
            *(
                inspect.Parameter(
                    option.name, keyword, default=option.default, annotation=option.type
                )
                for option in fields(EngineConfig)
                if option.name in ENGINE_OPTIONS
            ),
        ],
        return_annotation="None",
    )


def resolve_max_model_len(requested: int | None, context_len: int) -> int:
    """``max_model_len`` for a model that positions ``context_len`` tokens: ``requested`` as
    given (the executor refuses it beyond the model's limit, naming the limit), or when
    ``None`` the default ``DEFAULT_MAX_MODEL_LEN``, lowered to the model's limit."""
    if requested is not None:
        return requested
    return min(DEFAULT_MAX_MODEL_LEN, context_len)


# Where async scheduling is on when async_scheduling=None: the device types on which it was
# measured faster (docs/benchmarks.md, "Async scheduling").
ASYNC_SCHEDULING_BY_DEFAULT: frozenset[str] = frozenset()


def resolve_async_scheduling(config: EngineConfig, device: torch.device) -> bool:
    """Whether steps are planned one ahead: ``config.async_scheduling``, or when ``None`` on
    the devices where it was measured faster (never with pipeline parallelism)."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    return (
        config.pipeline_parallel_size == 1
        and config.speculative_config is None  # the next drafts follow this step's tokens
        and device.type in ASYNC_SCHEDULING_BY_DEFAULT
    )


def _positive_int(name: str, value: object, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigurationError(f"{name}={value!r} is invalid: expected an integer >= {minimum}.")
