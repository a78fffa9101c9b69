"""The engine's settings: validated at construction, device and dtype resolved."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pagedinfer.adapters.kv_cache import KV_CACHE_DTYPES
from pagedinfer.adapters.models.finite import WeightCheck, validate_weight_check
from pagedinfer.domain.grammar_limits import DEFAULT_GRAMMAR_LIMITS, GrammarLimits
from pagedinfer.domain.limits import (
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_N,
    DEFAULT_MAX_STOP,
    DEFAULT_MAX_STOP_STR_LEN,
    RequestLimits,
)
from pagedinfer.domain.scheduler import SCHEDULING_POLICIES, SchedulingPolicy
from pagedinfer.domain.speculative import SpeculativeConfig
from pagedinfer.errors import ConfigurationError

__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_MAX_MODEL_LEN",
    "KV_CACHE_DTYPES",
    "SCHEDULING_POLICIES",
    "EngineConfig",
    "available_cpus",
    "default_num_threads",
    "resolve_async_scheduling",
    "resolve_device",
    "resolve_dtype",
    "resolve_max_model_len",
    "resolve_num_threads",
]

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash")

DEFAULT_MAX_MODEL_LEN = 4096
"""``max_model_len`` when none is given, unless the model's limit is lower: small enough that
the KV cache of one sequence fits a CPU's memory (vLLM's default is the model's whole
context, 40,960 tokens for Qwen3, which a CPU cache of float32 KV would spend gigabytes on)."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """``Engine``'s keyword arguments, checked. See :class:`pagedinfer.Engine` for meanings."""

    model_path: str
    device: str | torch.device = "auto"
    dtype: str | torch.dtype = "auto"
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    max_model_len: int | None = None  # None: DEFAULT_MAX_MODEL_LEN or the model's limit
    kv_block_size: int = 256
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    seed: int = 0
    kv_cache_memory_bytes: int | None = None
    num_threads: int | str | None = None  # None: torch's own; "auto": default_num_threads()
    worker_timeout_s: float = 120.0
    scheduling_policy: SchedulingPolicy = "mixed"
    max_n: int = DEFAULT_MAX_N
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_stop: int = DEFAULT_MAX_STOP
    max_stop_str_len: int = DEFAULT_MAX_STOP_STR_LEN
    max_consecutive_failed_steps: int = 3
    tokenizer: str | None = None  # a directory; None: the model's
    skip_tokenizer_init: bool = False
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # "mp" or "ray"
    async_scheduling: bool | None = None  # None: resolve_async_scheduling's default
    # Speculative decoding: vLLM's dict ({"method": "ngram", ...}) or the checked config.
    speculative_config: SpeculativeConfig | Mapping[str, object] | None = None
    weight_check: WeightCheck = "default"  # which tensors must be finite at load
    # Structured outputs: what one constraint may cost (domain/grammar_limits.py).
    grammar_limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS

    @property
    def speculation(self) -> SpeculativeConfig | None:
        """``speculative_config``, checked (``None``: no speculative decoding)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_value(self.speculative_config)

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
        if self.distributed_executor_backend not in ("mp", "ray"):
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
        for name in ("enforce_eager", "enable_prefix_caching", "skip_tokenizer_init"):
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
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigurationError(f"seed={self.seed!r} must be an integer.")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigurationError(
                f"scheduling_policy={self.scheduling_policy!r} is unknown: choose one of "
                f"{', '.join(SCHEDULING_POLICIES)}."
            )


def resolve_max_model_len(requested: int | None, context_len: int, window: int | None) -> int:
    """``max_model_len`` for a model that positions ``context_len`` tokens (and whose
    sliding-window layers, if any, attend ``window`` tokens): ``requested`` as given (the
    executor refuses it beyond the model's limit, naming the limit), or when ``None`` the
    default ``DEFAULT_MAX_MODEL_LEN``, lowered to what the model can serve exactly."""
    if requested is not None:
        return requested
    return min(DEFAULT_MAX_MODEL_LEN, context_len, window or context_len)


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


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, bounded by a cgroup CPU quota
    (a container's ``--cpus``) where there is one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cpus, quota) if quota is not None else cpus)


def _cgroup_cpu_quota() -> int | None:
    """CPUs allowed by the cgroup v2 quota (``cpu.max``, rounded up), or None if unlimited."""
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as file:
            quota, period = file.read().split()[:2]
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def default_num_threads(tensor_parallel_size: int = 1) -> int:
    """``num_threads="auto"``: half the CPUs this process may use (:func:`available_cpus`),
    shared by the tensor-parallel ranks, at least 1.

    Half, not all: torch's CPU kernels split every operation across their threads and wait
    for the slowest, so when another busy process holds a core a step waits for a thread that
    is not running. Measured on 2 cores beside other work (docs/benchmarks.md): 2 threads
    decoded at 37 tok/s, 1 thread at 622 tok/s. On a machine of one's own, half the cores
    costs less than that collapse (torch's default: one thread per core).
    """
    return max(1, available_cpus() // 2 // max(1, tensor_parallel_size))


def resolve_num_threads(requested: int | str | None, tensor_parallel_size: int) -> int | None:
    """The thread count to set (``None``: leave torch's alone)."""
    if requested == "auto":
        return default_num_threads(tensor_parallel_size)
    assert requested is None or isinstance(requested, int)
    return requested


def _positive_int(name: str, value: object, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigurationError(f"{name}={value!r} is invalid: expected an integer >= {minimum}.")


def resolve_device(requested: str | torch.device) -> torch.device:
    """``"auto"`` picks CUDA when available, else the CPU."""
    if isinstance(requested, str) and requested == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else (torch.device("cpu"))
        )
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError) as error:
        raise ConfigurationError(
            f"device={requested!r} is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'."
        ) from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigurationError(
                f"device={requested!r} was requested but CUDA is not available; "
                "use 'cpu' or 'auto'."
            )
        return torch.device("cuda", device.index if device.index is not None else 0)
    if device.type != "cpu":
        raise ConfigurationError(f"device={requested!r} is not supported: use 'cpu' or 'cuda'.")
    return device


def resolve_dtype(
    requested: str | torch.dtype, device: torch.device, checkpoint_dtype: torch.dtype
) -> torch.dtype:
    """``"auto"``: the checkpoint's dtype on CUDA, float32 on the CPU."""
    if isinstance(requested, torch.dtype):
        dtype = requested
    elif requested == "auto":
        return checkpoint_dtype if device.type == "cuda" else torch.float32
    elif isinstance(requested, str) and requested in _DTYPES:
        dtype = _DTYPES[requested]
    else:
        raise ConfigurationError(
            f"dtype={requested!r} is not supported: use 'auto', 'float32', 'float16' or 'bfloat16'."
        )
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigurationError(
            f"dtype={dtype} is not supported: use float32, float16 or bfloat16."
        )
    return dtype
