"""The configurations of the engine's parts, derived from its own (:class:`EngineConfig`)
and what was resolved from the checkpoint and the machine: the executor's
(:class:`RunnerConfig`) and the scheduler's (:class:`SchedulerConfig`)."""

from __future__ import annotations

import logging
from collections.abc import Collection

import torch

from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain.kv_groups import KVGroupSpec, min_blocks_for_one_sequence
from pagedinfer.domain.scheduler import SchedulerConfig
from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.kv_capacity import log_kv_capacity
from pagedinfer.engine.kv_offloading import kv_offloading_bytes
from pagedinfer.engine.lora_options import cpu_lora_slots

__all__ = ["runner_config", "scheduler_config"]

_logger = logging.getLogger("pagedinfer.engine.kv_capacity")


def runner_config(
    config: EngineConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str,
    max_model_len: int,
    num_threads: int | None,
    pooling_type: str | None = None,
) -> RunnerConfig:
    """What the executor needs: ``config`` with the device, dtype, attention backend,
    ``max_model_len`` and CPU threads resolved."""
    speculation = config.speculation
    return RunnerConfig(
        model_path=config.model_path,
        device=device,
        dtype=dtype,
        block_size=config.kv_block_size,
        attention_backend=attention_backend,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
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
            speculation.model
            if speculation is not None and speculation.method == "draft_model"
            else None
        ),
        num_speculative_tokens=0 if speculation is None else speculation.num_speculative_tokens,
        weight_check=config.weight_check,
        logprobs_mode=config.logprobs_mode,
        pooling_type=pooling_type,
        batch_invariant=config.batch_invariant,
        max_loras=config.max_loras if config.enable_lora else 0,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=cpu_lora_slots(config.max_loras, config.max_cpu_loras),
        kv_offloading_bytes=kv_offloading_bytes(config),
    )


def scheduler_config(
    config: EngineConfig,
    runner: RunnerConfig,
    *,
    num_blocks: int,
    eos_token_ids: Collection[int],
    kv_groups: tuple[KVGroupSpec, ...] = (),
    num_host_blocks: int = 0,
) -> SchedulerConfig:
    """What the scheduler needs: ``config`` with the executor's KV cache (``num_blocks``),
    its KV groups and the runner's resolved sizes and drafts. Logs the KV cache's capacity,
    per KV group (:mod:`~pagedinfer.engine.kv_capacity`).

    One sliding group (every layer with the same window) uses the plain cache layout: when the
    pool is too small for the null block and the window's slack
    (:func:`~pagedinfer.domain.kv_groups.min_blocks_for_one_sequence`), the scheduler keeps
    one plain table per sequence instead (correct; nothing freed by the window)."""
    if len(kv_groups) == 1 and num_blocks < min_blocks_for_one_sequence(
        kv_groups, config.kv_block_size, runner.max_model_len, config.max_num_batched_tokens
    ):
        _logger.info(
            "every layer slides (window %s) but the KV pool is too small for the null block and "
            "the window's slack: one plain table per sequence (nothing freed by the window)",
            kv_groups[0].window,
        )
        kv_groups = ()
    scheduler = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=config.kv_block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=runner.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        eos_token_ids=frozenset(eos_token_ids),
        scheduling_policy=config.scheduling_policy,
        num_speculative_tokens=runner.num_speculative_tokens,
        # A draft model writes the K/V of its next drafts past a verify row.
        num_lookahead_tokens=(
            runner.num_speculative_tokens if runner.draft_model_path is not None else 0
        ),
        kv_groups=kv_groups,
        max_loras=runner.max_loras,
        num_host_blocks=num_host_blocks,
    )
    log_kv_capacity(scheduler)
    return scheduler
