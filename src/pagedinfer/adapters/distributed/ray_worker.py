"""One rank of a Ray-distributed engine: the body of a Ray actor (see ``ray_executor.py``).

This module does not import Ray: the executor wraps :class:`RayWorker` with ``ray.remote``
when it creates the actors, and the actor's methods use Ray only for the node's address.

Start-up, driven by the executor: global rank 0 hosts the engine's TCP store on its node's
address (:meth:`RayWorker.host_store`); then every rank :meth:`RayWorker.start`: it connects
to the store, joins its stage's tensor-parallel group (a ``PrefixStore`` per stage; NCCL on a
GPU, gloo bound to the node's address on the CPU) and, with pipeline parallelism, the group of
every rank (gloo, for agreeing on the KV-cache size), builds its runner (a whole-model
:class:`ModelRunner`, or a :class:`StageRunner`) and returns its number of KV blocks and its
KV groups (the executor checks that every rank agrees on both).

Each step the executor calls :meth:`RayWorker.execute` on every rank with the plan (through
Ray's object store) and, for stages after the first, the previous stage's output object:
Ray hands the method the previous stage's :class:`IntermediateTensors` once they exist, on
whatever node they were made.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, TCPStore

from pagedinfer.adapters.collective_rpc import RpcMethod, call_on_runner
from pagedinfer.adapters.distributed.group import (
    ProcessGroupCollectives,
    connect_store,
    host_store,
)
from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.distributed.pipeline import IntermediateTensors, PipelineStage
from pagedinfer.adapters.distributed.stage_runner import StageRunner
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.adapters.sampling.grammar import GrammarCompiler
from pagedinfer.domain.grammar_limits import DEFAULT_GRAMMAR_LIMITS, GrammarLimits
from pagedinfer.domain.kv_groups import KVGroupSpec
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.step_output import StepOutput
from pagedinfer.errors import EngineClosedError

__all__ = ["GrammarSpec", "RayWorker", "RayWorkerSpec"]


@dataclass(frozen=True)
class GrammarSpec:
    """What the sampling rank needs to compile structured-output grammars itself (the
    engine's compiler holds a lock and its cache: it does not travel)."""

    tokenizer: Any
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    cache_size: int
    limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS

    @staticmethod
    def of(compiler: GrammarCompiler) -> GrammarSpec:
        return GrammarSpec(
            compiler.tokenizer,
            compiler.vocab_size,
            compiler.eos_token_ids,
            compiler.cache_size,
            compiler.limits,
        )

    def compiler(self) -> GrammarCompiler:
        # The engine refused what fails these limits at submission: a grammar compiled here
        # (a cache miss on this process) passes them too.
        return GrammarCompiler(
            self.tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            cache_size=self.cache_size,
            limits=self.limits,
        )


@dataclass(frozen=True)
class RayWorkerSpec:
    """One rank's place: global rank ``stage.index * tp + tp_rank``."""

    global_rank: int
    world_size: int  # every rank of every stage
    tp_rank: int
    stage: PipelineStage | None  # None: no pipeline parallelism
    config: RunnerConfig  # this rank's device
    store_host: str
    store_port: int
    timeout_s: float  # collectives and the store while starting
    grammars: GrammarSpec | None  # the sampling rank only


class RayWorker:
    """The state of one rank inside its actor process."""

    def __init__(self) -> None:
        self._store: TCPStore | None = None
        self._groups: list[ProcessGroupCollectives] = []
        self._runner: ModelRunner | None = None
        self._busy_s = 0.0  # time spent inside execute (the bubble is the rest of a step)
        self._steps = 0

    def node_ip(self) -> str:
        """The address other nodes reach this actor's node at."""
        import ray

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]

    def where(self) -> tuple[str, str, int]:
        """``(node address, Ray node id, process id)`` of this actor."""
        import ray

        return self.node_ip(), str(ray.get_runtime_context().get_node_id()), os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def host_store(self, world_size: int, timeout_s: float) -> int:
        """Host the engine's TCP store on this node's address; return its port."""
        self._store = host_store(world_size, timedelta(seconds=timeout_s), host=self.node_ip())
        return int(self._store.port)

    def start(self, spec: RayWorkerSpec) -> tuple[int, tuple[KVGroupSpec, ...]]:
        """Join the groups, build this rank's runner; return its number of KV blocks and
        its KV groups (the whole model's, empty for one table per sequence)."""
        config = spec.config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # this actor's own process
        elif config.device.type == "cpu":
            torch.set_num_threads(1)  # ranks share the node's cores
        timeout = timedelta(seconds=spec.timeout_s)
        host = self.node_ip()
        store = self._store or connect_store(
            spec.store_host, spec.store_port, spec.world_size, timeout
        )
        self._store = store
        tp = config.tensor_parallel_size
        stage_index = 0 if spec.stage is None else spec.stage.index
        group: ProcessGroupCollectives | None = None
        if tp > 1:
            group = ProcessGroupCollectives(
                PrefixStore(f"tp{stage_index}/", store),
                rank=spec.tp_rank,
                world_size=tp,
                device=config.device,
                timeout=timeout,
                host=host,
            )
            self._groups.append(group)
        everyone: ProcessGroupCollectives | None = None
        if spec.stage is not None:
            everyone = ProcessGroupCollectives(
                PrefixStore("all/", store),
                rank=spec.global_rank,
                world_size=spec.world_size,
                device=torch.device("cpu"),
                timeout=timeout,
                host=host,
            )
            self._groups.append(everyone)
        parallel = ParallelContext(spec.tp_rank, tp, group, spec.stage, everyone)
        grammars = spec.grammars.compiler() if spec.grammars is not None else None
        if spec.stage is None:
            self._runner = ModelRunner(config, parallel, grammars=grammars)
        else:
            self._runner = StageRunner(config, parallel, grammars=grammars)
        for collectives in self._groups:
            collectives.step_timeout = timedelta(seconds=config.worker_timeout_s)
        return self._runner.num_kv_blocks, self._runner.kv_groups

    def execute(
        self, plan: BatchPlan, intermediate: IntermediateTensors | None
    ) -> StepOutput | IntermediateTensors | None:
        """Run one step (see :meth:`StageRunner.execute_stage`)."""
        runner = self._runner
        if runner is None:
            raise EngineClosedError("the Ray worker was used before start() or after close()")
        started = time.perf_counter()
        try:
            if isinstance(runner, StageRunner):
                return runner.execute_stage(plan, intermediate)
            output = runner.execute(plan)
            return output if runner.parallel.is_driver else None
        finally:
            self._busy_s += time.perf_counter() - started
            self._steps += 1

    def sleep(self, level: int) -> bool:
        """Sleep mode (``adapters/sleep_mode.py``); whether this rank sleeps now."""
        runner = self._runner
        if runner is None:
            raise EngineClosedError("the Ray worker was used before start() or after close()")
        runner.sleep(level)
        return runner.is_sleeping

    def wake_up(self, tags: list[str] | None) -> bool:
        """Take back what :meth:`sleep` freed; whether this rank still sleeps."""
        runner = self._runner
        if runner is None:
            raise EngineClosedError("the Ray worker was used before start() or after close()")
        runner.wake_up(tags)
        return runner.is_sleeping

    def rpc(self, method: RpcMethod, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One ``collective_rpc`` call on this rank's runner (``adapters/collective_rpc.py``)."""
        runner = self._runner
        if runner is None:
            raise EngineClosedError("the Ray worker was used before start() or after close()")
        return call_on_runner(runner, method, args, kwargs)

    def busy(self) -> tuple[int, float]:
        """``(steps run, seconds spent running them)`` since start-up."""
        return self._steps, self._busy_s

    def close(self) -> None:
        """Free the runner and the groups (the executor kills the actor afterwards)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.close()
        for group in self._groups:
            group.close()
        self._groups.clear()
        self._store = None
