"""The executor seen by the engine: something that runs a ``BatchPlan`` and samples.

``ModelRunner`` is the single-process executor; with ``tensor_parallel_size > 1`` the
tensor-parallel executor drives rank 0 in this process and mirrors every call to workers.
"""

from __future__ import annotations

from typing import Protocol

from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.step_output import StepOutput

__all__ = ["Executor", "create_executor"]


class Executor(Protocol):
    num_kv_blocks: int

    def execute(self, plan: BatchPlan) -> StepOutput:
        """Run one step; return a token per sampled row (``plan.sample_indices``), and the
        logprobs the plan's requests asked for."""
        ...

    def close(self) -> None:
        """Release devices, processes and memory. Safe to call twice."""
        ...


def create_executor(config: RunnerConfig) -> Executor:
    if config.tensor_parallel_size == 1:
        from pagedinfer.adapters.model_runner import ModelRunner

        return ModelRunner(config)
    from pagedinfer.adapters.distributed.executor import TensorParallelExecutor

    return TensorParallelExecutor(config)
