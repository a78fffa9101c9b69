"""``RayExecutor``: every rank a Ray actor, placed by placement groups, driven through Ray.

``distributed_executor_backend="ray"`` runs the engine's ``tensor_parallel_size x
pipeline_parallel_size`` ranks as Ray actors (:class:`~.ray_worker.RayWorker`), one GPU (or one
CPU) each, as vLLM's Ray executor does. The engine's process holds no model: it may run on a
machine without a GPU (a head node, a Ray Data or Serve replica).

Cluster: the one this process is connected to; otherwise ``ray.init()``, which connects to
the cluster named by ``RAY_ADDRESS`` or started on this machine by ``ray start``, or starts a
local one.

Placement: one bundle per rank (``{"GPU": 1}`` on CUDA, ``{"CPU": 1}`` on the CPU). Each
pipeline stage's tensor-parallel group is one placement group with ``STRICT_PACK`` (its
all-reduces stay inside a node); stages are separate groups, so they may land on different
nodes (only a hidden-state tensor crosses between them). When this process already runs
inside a placement group (a Ray Data or Serve replica placed by its caller with
``placement_group_capture_child_tasks``), its bundles 0..N-1 are used instead, in rank
order (stage-major), and the caller decides the strategy. Before any actor starts, a group
that no node can hold is refused with the cluster's resources in the message; a feasible
group that stays unplaced (resources busy) for ``placement_timeout_s`` is refused too.

Control: each step every actor's ``execute`` call carries the plan (the sampling rank's copy
keeps the sampler's fields, the others' do not), through Ray, to any node: Ray sends small
arguments with the call and moves large ones through its object store. With pipeline
parallelism, stage ``s+1``'s calls take stage ``s``'s rank-0 result as an argument: Ray
starts them when those intermediate tensors exist and moves them between nodes.
Collectives inside a stage: NCCL on GPUs, gloo on the CPU (bound to the node's address).

Failures: the executor waits for every rank's result, at most ``worker_timeout_s``; an
actor that died (a killed process, a lost node) raises :class:`WorkerDiedError` as soon as
Ray reports it, a stalled step :class:`WorkerTimeoutError`. After any failed step the
executor kills every actor and removes its placement groups; later calls raise the same
error. ``close()``, garbage collection and interpreter exit release the same way.
"""

from __future__ import annotations

import contextlib
import importlib
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pagedinfer.adapters.collective_rpc import RpcMethod
from pagedinfer.adapters.distributed.messages import execute_message
from pagedinfer.adapters.distributed.pipeline import PipelineStage, pipeline_stages
from pagedinfer.adapters.distributed.ray_worker import GrammarSpec, RayWorker, RayWorkerSpec
from pagedinfer.adapters.models.registry import read_model_config
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.adapters.sampling.grammar import GrammarCompiler
from pagedinfer.domain.executor import launch_now
from pagedinfer.domain.kv_groups import KVGroupSpec
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.step_output import StepOutput
from pagedinfer.errors import (
    ConfigurationError,
    EngineClosedError,
    MissingDependencyError,
    PagedInferError,
    WorkerDiedError,
    WorkerTimeoutError,
    install_hint,
)

__all__ = [
    "DEFAULT_PLACEMENT_TIMEOUT_S",
    "RayExecutor",
    "check_parallel_split",
    "import_ray",
]

DEFAULT_PLACEMENT_TIMEOUT_S = 120.0
"""How long a feasible placement group may wait for busy resources before start-up fails."""
STARTUP_TIMEOUT_S = 600.0
"""How long the actors may take to start, load their shards and size the KV cache."""
COLLECTIVE_TIMEOUT_S = 300.0
"""Store and collective timeout while starting (``worker_timeout_s`` once serving)."""
DEATH_GRACE_S = 5.0
"""After a failed step, how long to wait for Ray to report which actor died."""
SHUTDOWN_GRACE_S = 5.0
"""How long ``close()`` lets the actors free their runners before killing them."""


def import_ray() -> Any:
    """The ``ray`` module, or :class:`MissingDependencyError` naming the extra."""
    try:
        import ray
        import ray.util.placement_group
        import ray.util.scheduling_strategies
    except ImportError as error:
        raise MissingDependencyError(
            f"distributed_executor_backend='ray' needs Ray, which could not be imported "
            f"({error}): install it with {install_hint('ray')}, or use the default "
            "distributed_executor_backend='mp' on one machine."
        ) from error
    return ray


def check_parallel_split(config: RunnerConfig) -> list[PipelineStage] | None:
    """Refuse a split the model cannot take (before any actor starts); the stages, or None
    without pipeline parallelism."""
    model_config = read_model_config(config.model_path)
    model_config.check_tensor_parallel(config.tensor_parallel_size)
    model_config.check_max_model_len(config.max_model_len)
    if config.pipeline_parallel_size == 1:
        return None
    if config.kv_cache_dtype != "auto":
        raise ConfigurationError(
            f"kv_cache_dtype={config.kv_cache_dtype!r} is not supported with "
            f"pipeline_parallel_size={config.pipeline_parallel_size} (an FP8 cache calibrates "
            "its scales on the whole model): use kv_cache_dtype='auto' or "
            "pipeline_parallel_size=1."
        )
    return pipeline_stages(model_config.num_hidden_layers, config.pipeline_parallel_size)


@dataclass
class _Actors:
    """Everything the executor must release, apart from it (the finalizer holds this)."""

    ray: Any
    actors: list[Any] = field(default_factory=list)
    owned_groups: list[Any] = field(default_factory=list)  # placement groups we created
    healthy: bool = False

    def release(self) -> None:
        ray = self.ray
        if not ray.is_initialized():  # interpreter exit after ray.shutdown(): nothing left
            return
        graceful, self.healthy = self.healthy, False
        if graceful and self.actors:
            with contextlib.suppress(Exception):
                ray.wait(
                    [actor.close.remote() for actor in self.actors],
                    num_returns=len(self.actors),
                    timeout=SHUTDOWN_GRACE_S,
                )
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.actors.clear()
        for group in self.owned_groups:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(group)
        self.owned_groups.clear()


class RayExecutor:
    """Runs each ``BatchPlan`` on ``tensor_parallel_size x pipeline_parallel_size`` Ray
    actors; rank 0 of the last stage samples.

    ``placement_group``: run in these bundles (0..N-1, stage-major) instead of creating
    placement groups (default: the placement group this process runs in, if any).
    """

    num_kv_blocks: int
    kv_groups: tuple[KVGroupSpec, ...] = ()  # every rank's runner's (the whole model's)
    num_host_kv_blocks = 0  # no host KV tier with several ranks (engine/kv_offloading.py)
    # Runs each step to its end before the next: the engine fills in carried tokens.
    reads_carried_tokens = False

    def __init__(
        self,
        config: RunnerConfig,
        *,
        grammars: GrammarCompiler | None = None,
        placement_group: Any = None,
        placement_timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        stages = check_parallel_split(config)  # before Ray is even imported
        ray = import_ray()
        self._ray = ray
        self._tp = config.tensor_parallel_size
        self._pp = config.pipeline_parallel_size
        self._step_timeout_s = config.worker_timeout_s
        self._failure: tuple[type[WorkerDiedError], str] | None = None
        self._sleeping = False  # sleep mode: whether a rank sleeps (sleep_mode.py)
        self._released = _Actors(ray)
        self._finalizer = weakref.finalize(self, self._released.release)
        self._nodes: list[str] = []
        self._pids: list[int] = []
        if not ray.is_initialized():
            ray.init()
        try:
            self._start(
                config, stages, grammars, placement_group, placement_timeout_s, startup_timeout_s
            )
        except BaseException as error:
            died = None if isinstance(error, PagedInferError) else self._failed_actor_error(error)
            self._finalizer()
            if died is None:
                raise
            try:
                raise died from error
            finally:
                died = None

    # ------------------------------------------------------------------ queries
    @property
    def world_size(self) -> int:
        return self._tp * self._pp

    @property
    def actors(self) -> list[Any]:
        """The rank actors, global rank order (stage-major); empty once released."""
        return list(self._released.actors)

    @property
    def actor_node_ids(self) -> list[str]:
        """The Ray node id of each rank's actor (as placed at start-up)."""
        return list(self._nodes)

    @property
    def actor_pids(self) -> list[int]:
        """The process id of each rank's actor (on its node)."""
        return list(self._pids)

    @property
    def placement_groups(self) -> list[Any]:
        """The placement groups this executor created (empty when it used the caller's)."""
        return list(self._released.owned_groups)

    def busy_seconds(self) -> list[float]:
        """Seconds each rank spent inside its steps since start-up (global rank order): with
        pipeline parallelism, a stage's share of the wall time of the steps is its
        utilization, and the rest is the pipeline bubble (docs/scaling.md)."""
        actors = self._released.actors
        busy = self._wait_all([a.busy.remote() for a in actors], self._step_timeout_s, "busy")
        return [float(seconds) for _, seconds in busy]

    # ------------------------------------------------------------------ steps
    def launch(self, plan: BatchPlan) -> Callable[[], StepOutput]:
        """:meth:`execute` now, its output handed back by the returned callable (steps do
        not overlap here)."""
        return launch_now(self.execute, plan)

    def execute(self, plan: BatchPlan) -> StepOutput:
        """Run one step on every rank; return the sampling rank's output."""
        if self._failure is not None:
            kind, message = self._failure
            raise kind(message)
        actors = self._released.actors
        if not actors:
            raise EngineClosedError("the Ray executor was used after close()")
        started = time.monotonic()
        try:
            # Plans travel with the calls: Ray inlines small arguments (a decode step's plan is
            # kilobytes) and puts large ones in its object store itself. An explicit ray.put
            # per step cost a quarter of the step time on the CPU benchmark.
            full = plan
            stripped = execute_message(plan)[1]
            refs: list[Any] = []
            previous: Any = None
            for stage in range(self._pp):
                last = stage == self._pp - 1
                stage_refs = [
                    actors[stage * self._tp + rank].execute.remote(
                        full if last and rank == 0 else stripped, previous
                    )
                    for rank in range(self._tp)
                ]
                previous = stage_refs[0]
                refs += stage_refs
            results = self._wait_all(refs, self._step_timeout_s, "a step")
            output = results[(self._pp - 1) * self._tp]
            assert isinstance(output, StepOutput), output
            return output
        except BaseException as error:
            dead, silent = self._probe()
            timed_out = isinstance(error, WorkerTimeoutError) or (
                time.monotonic() - started >= self._step_timeout_s
            )
            died: WorkerDiedError | None = dead
            if died is None and (timed_out or silent):
                who = f"rank(s) {', '.join(self._describe_rank(r) for r in silent)}"
                died = WorkerTimeoutError(
                    f"a step did not finish within worker_timeout_s={self._step_timeout_s:g} s "
                    f"on the Ray workers ({who if silent else 'every rank answers now'}); the "
                    "engine cannot continue: close it and create a new Engine (raise "
                    "worker_timeout_s for slower steps)."
                )
            if died is None:
                died = self._step_error(error)
            self._failure = (type(died), str(died))
            self._released.healthy = False  # no graceful close: a rank may not answer
            self._finalizer()
            try:
                raise died from error
            finally:
                died = None  # no reference cycle through this frame

    # --------------------------------------------------------------- sleep mode
    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    def sleep(self, level: int = 1) -> None:
        """Every rank frees its KV cache (and weights: level 2; ``adapters/sleep_mode.py``)."""
        self._sleeping = self._on_every_actor("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Every rank takes back what :meth:`sleep` freed (``tags``: which halves)."""
        self._sleeping = self._on_every_actor("wake_up", tags)

    def _on_every_actor(self, method: str, argument: object) -> bool:
        if self._failure is not None:
            kind, message = self._failure
            raise kind(message)
        actors = self._released.actors
        if not actors:
            raise EngineClosedError("the Ray executor was used after close()")
        refs = [getattr(actor, method).remote(argument) for actor in actors]
        return any(self._wait_all(refs, self._step_timeout_s, f"{method}()"))

    def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``method`` on every rank's actor (``adapters/collective_rpc.py``; Ray pickles
        it, so a lambda works too); the results in global rank order (stage by stage). An
        actor's error is raised as Ray raises it (an instance of the original class too)."""
        if self._failure is not None:
            kind, message = self._failure
            raise kind(message)
        actors = self._released.actors
        if not actors:
            raise EngineClosedError("the Ray executor was used after close()")
        call_kwargs = dict(kwargs or {})
        refs = [actor.rpc.remote(method, args, call_kwargs) for actor in actors]
        limit = self._step_timeout_s if timeout is None else timeout
        return self._wait_all(refs, limit, "a collective_rpc call")

    def close(self) -> None:
        """Stop every actor and remove the placement groups. Idempotent."""
        self._finalizer()

    # ------------------------------------------------------------------ start-up
    def _start(
        self,
        config: RunnerConfig,
        stages: list[PipelineStage] | None,
        grammars: GrammarCompiler | None,
        placement_group: Any,
        placement_timeout_s: float,
        startup_timeout_s: float,
    ) -> None:
        ray = self._ray
        on_gpu = config.device.type == "cuda"
        unit = "GPU" if on_gpu else "CPU"
        bundles = self._bundles(unit, placement_group, placement_timeout_s)
        worker_class = ray.remote(RayWorker)
        strategies = importlib.import_module("ray.util.scheduling_strategies")
        for group, index in bundles:
            options: dict[str, Any] = {
                "num_cpus": 0 if on_gpu else 1,
                "num_gpus": 1 if on_gpu else 0,
                "max_restarts": 0,
                "scheduling_strategy": strategies.PlacementGroupSchedulingStrategy(
                    placement_group=group,
                    placement_group_bundle_index=index,
                    placement_group_capture_child_tasks=False,
                ),
            }
            self._released.actors.append(worker_class.options(**options).remote())
        actors = self._released.actors
        where = self._wait_all([a.where.remote() for a in actors], startup_timeout_s, "start-up")
        self._nodes = [node_id for _, node_id, _ in where]
        self._pids = [pid for _, _, pid in where]
        port = self._wait_all(
            [actors[0].host_store.remote(self.world_size, COLLECTIVE_TIMEOUT_S)],
            startup_timeout_s,
            "start-up",
        )[0]
        # Ray sets CUDA_VISIBLE_DEVICES of each actor to its one GPU.
        device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
        rank_config = replace(config, device=device)
        starts = []
        for global_rank, actor in enumerate(actors):
            stage_index, tp_rank = divmod(global_rank, self._tp)
            samples = stage_index == self._pp - 1 and tp_rank == 0
            spec = RayWorkerSpec(
                global_rank=global_rank,
                world_size=self.world_size,
                tp_rank=tp_rank,
                stage=None if stages is None else stages[stage_index],
                config=rank_config,
                store_host=where[0][0],
                store_port=port,
                timeout_s=COLLECTIVE_TIMEOUT_S,
                grammars=GrammarSpec.of(grammars) if samples and grammars is not None else None,
            )
            starts.append(actor.start.remote(spec))
        started = self._wait_all(starts, startup_timeout_s, "start-up")
        # The ranks agreed on the minimum; every rank and stage groups the whole model alike.
        assert len(set(started)) == 1, started
        blocks, kv_groups = started[0]
        self.num_kv_blocks = int(blocks)
        self.kv_groups = tuple(kv_groups)
        self._released.healthy = True

    def _bundles(self, unit: str, given: Any, placement_timeout_s: float) -> list[tuple[Any, int]]:
        """(placement group, bundle index) of each rank, global rank order."""
        # The module (ray.util.placement_group is also the name of its function).
        pg_module = importlib.import_module("ray.util.placement_group")
        if given is None:
            given = pg_module.get_current_placement_group()
        if given is not None:
            count = len(given.bundle_specs)
            if count < self.world_size:
                raise ConfigurationError(
                    f"the placement group this engine runs in has {count} bundles, and "
                    f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks "
                    "need one each: give the group more bundles, or start the engine outside it."
                )
            short = [
                index
                for index, bundle in enumerate(given.bundle_specs[: self.world_size])
                if float(bundle.get(unit, 0.0)) < 1.0
            ]
            if short:
                raise ConfigurationError(
                    f"bundle(s) {short} of the placement group this engine runs in hold less "
                    f"than one {unit}, and each rank needs one ({unit.lower()} engine): give "
                    f"every bundle {{{unit!r}: 1}}."
                )
            return [(given, index) for index in range(self.world_size)]
        self._check_feasible(unit)
        bundles: list[tuple[Any, int]] = []
        # Names must be unique among live groups: several engines may share a cluster.
        engine_id = uuid.uuid4().hex[:12]
        for stage in range(self._pp):
            group = pg_module.placement_group(
                [{unit: 1.0}] * self._tp,
                strategy="STRICT_PACK",
                name=f"pagedinfer-{engine_id}-stage{stage}",
            )
            self._released.owned_groups.append(group)
            bundles += [(group, index) for index in range(self._tp)]
        deadline = time.monotonic() + placement_timeout_s
        for group in self._released.owned_groups:
            remaining = max(0.0, deadline - time.monotonic())
            if not group.wait(timeout_seconds=remaining):
                raise ConfigurationError(
                    f"the Ray cluster did not place {self._pp} group(s) of "
                    f"{self._tp} x {{{unit!r}: 1}} (STRICT_PACK) within "
                    f"{placement_timeout_s:g} s: its free resources are "
                    f"{self._describe_nodes(available=True)}. Free the resources (other "
                    "engines or jobs hold them) or add nodes."
                )
        return bundles

    def _check_feasible(self, unit: str) -> None:
        """Refuse at once what no free or busy node of the cluster could ever hold."""
        per_node = [
            float(node["Resources"].get(unit, 0.0))
            for node in self._ray.nodes()
            if node.get("Alive", False)
        ]
        slots = sorted((int(amount) // 1 for amount in per_node), reverse=True)
        # Stages are STRICT_PACK groups of tp bundles: count how many fit, node by node.
        groups = sum(int(amount) // self._tp for amount in slots)
        if groups < self._pp:
            raise ConfigurationError(
                f"the Ray cluster cannot place tensor_parallel_size={self._tp} x "
                f"pipeline_parallel_size={self._pp}: each pipeline stage needs {self._tp} "
                f"{unit}(s) on one node (STRICT_PACK), and its nodes have "
                f"{self._describe_nodes(available=False)}. Lower tensor_parallel_size or "
                f"pipeline_parallel_size, or add nodes with {self._tp} {unit}s each."
            )

    def _describe_nodes(self, *, available: bool) -> str:
        ray = self._ray
        if available:
            with contextlib.suppress(Exception):
                from ray._private.state import available_resources_per_node

                per_node = available_resources_per_node()  # type: ignore[no-untyped-call]
                return (
                    "; ".join(
                        f"node {node_id[:8]}: " + _resources(resources)
                        for node_id, resources in per_node.items()
                    )
                    or "none"
                )
        nodes = [node for node in ray.nodes() if node.get("Alive", False)]
        return (
            "; ".join(
                f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]}): "
                + _resources(node["Resources"])
                for node in nodes
            )
            or "no live node"
        )

    # ------------------------------------------------------------------ waiting
    def _wait_all(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        """Every ref's value, in order; the first failure raises as soon as Ray reports it."""
        ray = self._ray
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(
                pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                raise WorkerTimeoutError(
                    f"the Ray workers did not finish {what} within {timeout_s:g} s; the "
                    "engine cannot continue: close it and create a new Engine."
                )
            ray.get(ready)  # raises the actor's error or its death
        return list(ray.get(refs))

    def _failed_actor_error(self, error: BaseException) -> WorkerDiedError | None:
        """The error to raise for a failed start-up: a dead actor's, a worker's, or None
        (raise ``error`` itself)."""
        dead, _ = self._probe()
        if dead is not None:
            return dead
        if isinstance(error, WorkerDiedError):
            return error
        if isinstance(error, self._ray.exceptions.RayTaskError):
            return self._step_error(error)
        return None

    def _step_error(self, error: BaseException) -> WorkerDiedError:
        if isinstance(error, WorkerDiedError):
            return error
        if isinstance(error, self._ray.exceptions.RayTaskError):
            return WorkerDiedError(
                f"a Ray worker failed: {_first_line(error)}; the engine cannot continue: "
                "close it and create a new Engine."
            )
        return WorkerDiedError(
            f"the Ray workers were stopped after a step failed ({error!r}); the engine "
            "cannot continue: close it and create a new Engine."
        )

    def _describe_rank(self, rank: int) -> str:
        stage, tp_rank = divmod(rank, self._tp)
        node = self._nodes[rank][:8] if rank < len(self._nodes) else "?"
        pid = self._pids[rank] if rank < len(self._pids) else "?"
        return f"{rank} (stage {stage}, tensor-parallel rank {tp_rank}, pid {pid} on node {node})"

    def _probe(self) -> tuple[WorkerDiedError | None, list[int]]:
        """Ask every actor for its pid: ``(the error of the first that is dead, the ranks
        that did not answer within DEATH_GRACE_S)``."""
        ray = self._ray
        actors = self._released.actors
        if not actors or not ray.is_initialized():
            return None, []
        probes = {actor.pid.remote(): rank for rank, actor in enumerate(actors)}
        deadline = time.monotonic() + DEATH_GRACE_S
        pending = list(probes)
        while pending:
            ready, pending = ray.wait(
                pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                break
            try:
                ray.get(ready)
            except ray.exceptions.RayActorError as died:
                return WorkerDiedError(
                    f"Ray worker rank {self._describe_rank(probes[ready[0]])} died: "
                    f"{_first_line(died)}; the engine cannot continue: close it and create a "
                    "new Engine."
                ), []
            except Exception:
                continue
        return None, sorted(probes[ref] for ref in pending)


def _resources(resources: dict[str, Any]) -> str:
    shown = {k: v for k, v in resources.items() if k in ("CPU", "GPU")}
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items())) or "no CPU or GPU"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[-1] if text else type(error).__name__
