"""What a model runner is built from: the engine's settings, already resolved."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedinfer.adapters.models.finite import WeightCheck
from pagedinfer.adapters.sampling.logprobs_mode import DEFAULT_LOGPROBS_MODE, LogprobsMode
from pagedinfer.domain.limits import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    max_running,
)

__all__ = ["RunnerConfig"]


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    model_path: str
    device: torch.device  # resolved: cpu, or a concrete cuda device
    dtype: torch.dtype  # resolved model dtype (and the KV cache's with kv_cache_dtype "auto")
    block_size: int
    attention_backend: str  # resolved: "torch", "triton" or "flash"
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    num_kv_blocks: int | None = None  # None: size from memory (GPU budget / free RAM)
    kv_cache_memory_bytes: int | None = None  # the KV cache's size in bytes, if given
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    seed: int = 0
    tensor_parallel_size: int = 1
    num_threads: int | None = None  # torch's CPU threads in each worker process, if given
    worker_timeout_s: float = 120.0  # how long a tensor-parallel peer may stall a step
    kv_cache_dtype: str = "auto"  # "auto" (dtype), "fp8" / "fp8_e4m3", "fp8_e5m2"
    pipeline_parallel_size: int = 1  # stages of decoder layers (Ray executor only)
    distributed_executor_backend: str = "mp"  # "mp" (local processes) or "ray"
    # Speculative decoding with a draft model: its checkpoint and the drafts per step.
    draft_model_path: str | None = None
    num_speculative_tokens: int = 0
    # Which tensors must be finite at load (adapters/models/finite.py).
    weight_check: WeightCheck = "default"
    # What the logprobs of sampled tokens report (adapters/sampling/logprobs_mode.py).
    logprobs_mode: LogprobsMode = DEFAULT_LOGPROBS_MODE
    # A pooling model (runner="pooling"): "LAST", "MEAN" or "CLS" (adapters/pooling/pooler.py).
    pooling_type: str | None = None
    # Fixed reduction splits, whatever shares the batch (adapters/batch_invariant.py).
    batch_invariant: bool = False
    # LoRA (adapters/lora): device slots (0: LoRA off), the largest rank, host copies kept.
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    # Host KV tier (adapters/host_kv_tier.py): its bytes of host memory; 0: none.
    kv_offloading_bytes: int = 0

    @property
    def max_running(self) -> int:
        """The most sequences in one step (the scheduler's ``max_running``)."""
        return max_running(self.max_num_seqs, self.max_num_batched_tokens)
