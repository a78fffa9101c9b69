"""The executor seen by the engine: something that runs a ``BatchPlan`` and samples.

The contract (what ``execute`` receives, returns and may raise, how a failed step is
recovered, when a plan counts as recorded) is :mod:`pagedinfer.domain.executor`'s, written
for executors without torch too. :class:`ModelExecutor` adds what the engine needs from its
own: the KV cache's size and ``close()``. ``ModelRunner`` is the single-process executor; with
``tensor_parallel_size > 1`` the tensor-parallel executor drives rank 0 in this process and
mirrors every call to workers (``mp``), or the Ray executor drives every rank as a Ray actor
(``ray``, with pipeline parallelism too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain.executor import Executor
from pagedinfer.errors import ConfigurationError

if TYPE_CHECKING:
    from pagedinfer.adapters.sampling.grammar import GrammarCompiler

__all__ = ["Executor", "ModelExecutor", "create_executor"]


class ModelExecutor(Executor, Protocol):
    """An :class:`~pagedinfer.domain.executor.Executor` that owns a model and its KV cache."""

    num_kv_blocks: int

    def close(self) -> None:
        """Release devices, processes and memory. Safe to call twice."""
        ...


def create_executor(
    config: RunnerConfig, *, grammars: GrammarCompiler | None = None
) -> ModelExecutor:
    """The executor for ``config``; ``grammars`` (structured outputs) goes to the sampling rank.

    ``distributed_executor_backend="ray"`` runs every rank as a Ray actor (pipeline
    parallelism needs it); with one rank the model runs in this process either way.
    """
    if config.distributed_executor_backend == "ray" and (
        config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1
    ):
        from pagedinfer.adapters.distributed.ray_executor import RayExecutor

        return RayExecutor(config, grammars=grammars)
    if config.pipeline_parallel_size > 1:
        raise ConfigurationError(
            f"pipeline_parallel_size={config.pipeline_parallel_size} needs "
            f"distributed_executor_backend='ray' (got {config.distributed_executor_backend!r}): "
            "the local executor runs tensor parallelism only."
        )
    if config.tensor_parallel_size == 1:
        from pagedinfer.adapters.model_runner import ModelRunner

        return ModelRunner(config, grammars=grammars)
    from pagedinfer.adapters.distributed.executor import TensorParallelExecutor

    return TensorParallelExecutor(config, grammars=grammars)
