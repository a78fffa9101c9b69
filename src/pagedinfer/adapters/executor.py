"""The executor seen by the engine: something that runs a ``BatchPlan`` and samples.

The contract (what ``execute`` receives, returns and may raise, how a failed step is
recovered, when a plan counts as recorded) is :mod:`pagedinfer.domain.executor`'s, written
for executors without torch too. :class:`ModelExecutor` adds what the engine needs from its
own: the KV cache's size, ``close()``, and the two halves of a step for async scheduling
(``launch`` and the callable it returns; ``reads_carried_tokens`` says whether a plan made
ahead of the previous step's tokens may be launched as it is). ``ModelRunner`` is the
single-process executor; with
``tensor_parallel_size > 1`` the tensor-parallel executor drives rank 0 in this process and
mirrors every call to workers (``mp``), or the Ray executor drives every rank as a Ray actor
(``ray``, with pipeline parallelism too).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from pagedinfer.adapters.collective_rpc import RpcMethod
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain.executor import Executor
from pagedinfer.domain.kv_groups import KVGroupSpec
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.step_output import StepOutput
from pagedinfer.errors import ConfigurationError

if TYPE_CHECKING:
    from pagedinfer.adapters.sampling.grammar import GrammarCompiler

__all__ = ["Executor", "ModelExecutor", "create_executor"]


class ModelExecutor(Executor, Protocol):
    """An :class:`~pagedinfer.domain.executor.Executor` that owns a model and its KV cache."""

    num_kv_blocks: int
    # Hybrid attention: the KV groups the plans must carry tables for (SchedulerConfig's
    # kv_groups); empty: one table per sequence.
    kv_groups: tuple[KVGroupSpec, ...]

    @property
    def num_host_kv_blocks(self) -> int:
        """The host KV tier's slots (0: no tier; ``kv_offloading_size``)."""
        ...

    @property
    def reads_carried_tokens(self) -> bool:
        """Whether :meth:`launch` writes a plan's carried rows (``plan.carried_rows``: the
        tokens the previous step samples) itself, from its device. If not, the engine fills
        them in on the host once the previous step's output is back."""
        ...

    def launch(self, plan: BatchPlan) -> Callable[[], StepOutput]:
        """:meth:`execute` in two halves: start ``plan``'s step and return what waits for
        its output (call it once, before the next step's output is read). An executor that
        overlaps steps returns before the step ends; the others run it now
        (:func:`~pagedinfer.domain.executor.launch_now`)."""
        ...

    @property
    def is_sleeping(self) -> bool:
        """Whether :meth:`sleep` freed the KV cache or the weights (not woken up yet)."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1; on CUDA the weights move to host memory) or the KV
        cache and the weights (level 2): ``adapters/sleep_mode.py``."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what :meth:`sleep` freed (``tags``: ``"weights"``, ``"kv_cache"``)."""
        ...

    def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``method`` on every rank's runner between steps; the results in rank order
        (``adapters/collective_rpc.py``). ``timeout`` (seconds; None: the executor's step
        timeout) bounds the wait for the other ranks."""
        ...

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
