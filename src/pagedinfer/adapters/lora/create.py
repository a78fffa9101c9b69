"""Build a model runner's :class:`~pagedinfer.adapters.lora.runtime.LoRARuntime` from its
settings (``None`` when LoRA is off)."""

from __future__ import annotations

from torch import nn

from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.lora.runtime import LoRARuntime
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.errors import ConfigurationError

__all__ = ["create_lora_runtime"]


def create_lora_runtime(
    model: nn.Module, model_config: ModelConfig, config: RunnerConfig, parallel: ParallelContext
) -> LoRARuntime | None:
    """The adapters' hooks and slots on ``model`` (``config.max_loras`` slots), or None."""
    if config.max_loras == 0:
        return None
    if parallel.stage is not None:
        raise ConfigurationError(
            "LoRA adapters run without pipeline parallelism (pipeline_parallel_size=1): "
            "splitting adapters across stages is not implemented."
        )
    return LoRARuntime(
        model,
        model_config,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=max(config.max_cpu_loras, config.max_loras),
        max_tokens=config.max_num_batched_tokens,
        device=config.device,
        dtype=config.dtype,
        use_kernels=config.device.type == "cuda",
        parallel=parallel,
    )
