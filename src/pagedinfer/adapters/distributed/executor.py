"""Placeholder until the tensor-parallel executor lands (worker processes + control channel)."""

from __future__ import annotations

from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.errors import ConfigurationError

__all__ = ["TensorParallelExecutor"]


class TensorParallelExecutor:
    num_kv_blocks: int

    def __init__(self, config: RunnerConfig) -> None:
        raise ConfigurationError(
            f"tensor_parallel_size={config.tensor_parallel_size} is not supported yet."
        )

    def execute(self, plan: BatchPlan) -> list[int]:
        raise NotImplementedError

    def close(self) -> None:
        return None
