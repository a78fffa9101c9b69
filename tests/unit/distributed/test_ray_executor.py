"""``distributed_executor_backend="ray"`` on a local two-node Ray cluster (gloo on the CPU).

One ``ray.cluster_utils.Cluster`` for the module: a head and a worker node, both on
127.0.0.1, two CPUs each (so one tensor-parallel group of two fills a node). Every engine
is checked token for token against one in-process TP=1 engine, on greedy and seeded
requests whose prompts share a prefix (prefix-cache hits) and outgrow a 12-block cache
(preemption). Engines are few (each starts Ray actors that import torch): TP=2 spread over
the two nodes, PP=2 over the two nodes, TP=2 x PP=2 (one stage per node), a hybrid-attention
model (KV groups) under TP=2 and PP=2, one killed mid-generation; placements that cannot
happen start no actor.

Skipped when Ray is not installed; ``pytest -m ray`` runs them alone.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from safetensors.torch import load_file

from pagedinfer import Engine, SamplingParams
from pagedinfer.errors import ConfigurationError, WorkerDiedError, WorkerTimeoutError

from .tp_helpers import shared_prefix_prompts

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from pagedinfer.adapters.distributed import ray_executor  # noqa: E402 (after the skip)
from pagedinfer.adapters.distributed.ray_executor import RayExecutor  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=0.9, top_k=40, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(5)
]
# The TP tests' settings: prompts of up to 82 tokens chunk (48 per step), share two cached
# prefix blocks, and 5 of them preempt each other in 12 blocks of 16 tokens.
SETTINGS: dict[str, Any] = {
    "device": "cpu",
    "kv_block_size": 16,
    "max_model_len": 128,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 48,
    "num_kv_blocks": 12,
    "enable_prefix_caching": True,
    "worker_timeout_s": 30.0,
}
PROMPTS = shared_prefix_prompts(seed=7, count=5)
NODE_CPUS = 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Head + one worker node on 127.0.0.1; this process connected to it."""
    assert not ray.is_initialized(), "another test left a Ray connection open"
    with pytest.MonkeyPatch.context() as patch:
        # Ray replaces 127.0.0.1 in an address by the host's "reachable" address unless it
        # believes multi-node clusters are off; the nodes listen on 127.0.0.1 only.
        patch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        patch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        node = {
            "num_cpus": NODE_CPUS,
            "node_ip_address": "127.0.0.1",
            "object_store_memory": 80 * 1024**2,
        }
        # A lost node is noticed in about 2 s instead of Ray's default 15 s or more.
        health = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
        local = cluster_utils.Cluster(
            initialize_head=True,
            head_node_args={**node, "include_dashboard": False, "_system_config": health},
        )
        try:
            local.add_node(**node)
            local.wait_for_nodes()
            ray.init(address=local.address, log_to_driver=False)
            yield local
        finally:
            ray.shutdown()
            local.shutdown()


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny")  # 2 layers, 4 query heads, 2 KV heads, tied embeddings


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> dict[str, list[list[int]]]:
    """The TP=1 engine's greedy and seeded tokens (checked against transformers elsewhere)."""
    with Engine(checkpoint, **SETTINGS) as engine:
        return _run(engine)


def _run(engine: Engine) -> dict[str, list[list[int]]]:
    greedy = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    seeded = engine.generate(PROMPTS, SEEDED, use_tqdm=False)
    stats = engine.stats()
    return {
        "greedy": [output.outputs[0].token_ids for output in greedy],
        "seeded": [output.outputs[0].token_ids for output in seeded],
        "preempted": [int(stats.num_preemptions > 0)],
        "cached": [int(any(o.num_cached_tokens > 0 for o in (*greedy, *seeded)))],
    }


def _spread_over_nodes(
    patch: pytest.MonkeyPatch, bundles: int, strategy: str = "STRICT_SPREAD"
) -> Any:
    """Make the next Engine run its ranks in a placement group of ``bundles`` CPUs spread over
    the nodes (as a caller that places the engine itself would); returns the group."""
    from ray.util.placement_group import placement_group

    group = placement_group([{"CPU": 1}] * bundles, strategy=strategy)
    assert group.wait(timeout_seconds=30)

    def create(config: Any, *, grammars: Any = None) -> RayExecutor:
        return RayExecutor(config, grammars=grammars, placement_group=group)

    patch.setattr("pagedinfer.engine.engine.create_executor", create)
    return group


def _check_same_tokens(got: dict[str, list[list[int]]], want: dict[str, list[list[int]]]) -> None:
    assert want["preempted"] == [1] and want["cached"] == [1], "the workload lost its point"
    assert got["greedy"] == want["greedy"]
    assert got["seeded"] == want["seeded"]


def test_tensor_parallel_across_two_nodes_matches_one_rank(
    cluster: Any, checkpoint: Path, expected: dict[str, list[list[int]]]
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        group = _spread_over_nodes(patch, 2)
        engine = Engine(
            checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray", **SETTINGS
        )
    try:
        executor = engine._executor
        assert isinstance(executor, RayExecutor)
        assert len(set(executor.actor_node_ids)) == 2, "the ranks share a node"
        assert executor.placement_groups == []  # the caller's group, not its own
        _check_same_tokens(_run(engine), expected)
    finally:
        engine.close()
        ray.util.remove_placement_group(group)


def test_pipeline_parallel_across_two_nodes_matches_one_rank(
    cluster: Any,
    checkpoint: Path,
    expected: dict[str, list[list[int]]],
    make_checkpoint: Callable[..., Path],
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        group = _spread_over_nodes(patch, 2)
        engine = Engine(
            checkpoint, pipeline_parallel_size=2, distributed_executor_backend="ray", **SETTINGS
        )
    try:
        executor = engine._executor
        assert isinstance(executor, RayExecutor)
        assert len(set(executor.actor_node_ids)) == 2, "the stages share a node"
        _check_same_tokens(_run(engine), expected)
        # collective_rpc reaches every stage (a lambda: Ray pickles it), and update_weights
        # too: each stage writes its own layers' tensors and skips the others'.
        held = engine.collective_rpc(lambda runner: list(runner.stage.layers))
        assert held == [[0], [1]]
        other = make_checkpoint("tiny", seed=1)
        engine.update_weights(load_file(str(other / "model.safetensors")))
        with Engine(other, **SETTINGS) as reference:
            want = reference.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        got = engine.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    finally:
        engine.close()
        ray.util.remove_placement_group(group)


def test_tensor_times_pipeline_parallel_matches_one_rank(
    cluster: Any, checkpoint: Path, expected: dict[str, list[list[int]]]
) -> None:
    """TP=2 x PP=2 through the executor's own placement groups: one STRICT_PACK group per
    stage, and each fills a node, so the stage boundary crosses nodes."""
    engine = Engine(
        checkpoint,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        **SETTINGS,
    )
    executor = engine._executor
    assert isinstance(executor, RayExecutor)
    groups = executor.placement_groups
    try:
        nodes = executor.actor_node_ids
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3], "a TP group spans nodes"
        assert nodes[0] != nodes[2], "both stages on one node"
        assert len(groups) == 2
        _check_same_tokens(_run(engine), expected)
    finally:
        engine.close()
    for group in groups:
        assert ray.util.placement_group_table(group)["state"] == "REMOVED"


# A tiny Gemma 3 (hybrid attention): sliding (window 8) and full layers alternating, so two
# KV groups, full [1, 3] and sliding [0, 2], of two layers each; each of two pipeline stages
# holds one layer of each group, so its blocks hold one layer. 17 blocks hold one 128-token
# sequence (8 + 8 and the null block): the prompts (40-69 tokens, several windows, 24 new
# tokens, greedy and seeded) preempt each other and free the blocks that leave the window.
HYBRID: dict[str, Any] = {
    "architecture": "Gemma3ForCausalLM",
    "num_hidden_layers": 4,
    "layer_types": ("sliding_attention", "full_attention") * 2,
    "sliding_window": 8,
    "query_pre_attn_scalar": 24,
    "vocab_size": 256,
}
HYBRID_SETTINGS = {**SETTINGS, "num_kv_blocks": 17}
HYBRID_PROMPTS = shared_prefix_prompts(seed=11, count=5, vocab=256)
HYBRID_PARAMS = [
    SamplingParams(temperature=0.0 if i % 2 == 0 else 0.9, seed=i, max_tokens=24, ignore_eos=True)
    for i in range(5)
]


@pytest.fixture(scope="module")
def hybrid_expected(make_checkpoint: Callable[..., Path]) -> tuple[Path, list[list[int]]]:
    """The tiny Gemma 3 and the single-process engine's tokens for it (that engine
    matches transformers: tests/unit/engine/test_hybrid_attention_parity.py)."""
    checkpoint = make_checkpoint("tiny", **HYBRID)
    with Engine(checkpoint, **HYBRID_SETTINGS) as engine:
        outputs = engine.generate(HYBRID_PROMPTS, HYBRID_PARAMS, use_tqdm=False)
        stats = engine.stats()
    assert stats.num_preemptions > 0, "the workload lost its point"
    assert [(g.window, g.num_layers) for g in stats.kv_groups] == [(None, 2), (8, 2)]
    return checkpoint, [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize(
    ("split", "block_layers"),
    [({"tensor_parallel_size": 2}, [2, 2]), ({"pipeline_parallel_size": 2}, [1, 1])],
    ids=["tp2", "pp2"],
)
def test_a_hybrid_model_keeps_its_kv_groups_on_every_rank_and_stage(
    cluster: Any,
    hybrid_expected: tuple[Path, list[list[int]]],
    split: dict[str, int],
    block_layers: list[int],
) -> None:
    """Every rank (and every stage, which holds two of the four layers) uses the whole
    model's groups; a stage's block holds its own layers of the block's group only."""
    checkpoint, expected = hybrid_expected
    engine = Engine(checkpoint, distributed_executor_backend="ray", **split, **HYBRID_SETTINGS)
    try:
        executor = engine._executor
        assert isinstance(executor, RayExecutor)
        assert [(g.window, g.layers) for g in executor.kv_groups] == [
            (None, (1, 3)),
            (8, (0, 2)),
        ]
        caches = engine.collective_rpc(
            lambda runner: (runner.num_block_layers, tuple(runner.kv_cache.shape[:3]))
        )
        assert caches == [(layers, (2, layers, 17)) for layers in block_layers]
        outputs = engine.generate(HYBRID_PROMPTS, HYBRID_PARAMS, use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == expected
        stats = engine.stats()
        assert stats.num_preemptions > 0
        assert [(g.window, g.num_layers) for g in stats.kv_groups] == [(None, 2), (8, 2)]
    finally:
        engine.close()


def test_an_actor_killed_mid_generation_raises_and_leaves_nothing(
    cluster: Any, checkpoint: Path
) -> None:
    engine = Engine(
        checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray", **SETTINGS
    )
    executor = engine._executor
    assert isinstance(executor, RayExecutor)
    actors, groups, pids = executor.actors, executor.placement_groups, executor.actor_pids
    assert len(set(executor.actor_node_ids)) == 1, "a TP group is STRICT_PACK"
    try:
        for prompt in PROMPTS[:2]:
            engine.add_request(prompt, GREEDY)
        engine.step()
        engine.step()
        assert engine.has_unfinished_requests()
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"rank 1 .*died"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - started < SETTINGS["worker_timeout_s"]
    finally:
        engine.close()
    # Nothing is left: the placement group is removed and no rank's process runs.
    assert ray.util.placement_group_table(groups[0])["state"] == "REMOVED"
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.pid.remote(), timeout=30)
    _assert_gone(pids)


def test_a_stalled_rank_times_out_and_is_named(
    cluster: Any, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that stops answering (SIGSTOP: a hung process) fails the step after
    ``worker_timeout_s`` (plus the grace for a death to show) with WorkerTimeoutError."""
    timeout_s = 3.0
    settings = {**SETTINGS, "worker_timeout_s": timeout_s}
    grace_s = 1.0  # how long the executor waits for a death to show before calling it a stall
    monkeypatch.setattr(ray_executor, "DEATH_GRACE_S", grace_s)
    engine = Engine(
        checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray", **settings
    )
    executor = engine._executor
    assert isinstance(executor, RayExecutor)
    pids = executor.actor_pids
    try:
        engine.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        os.kill(pids[1], signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match=r"rank\(s\) 1 \(stage 0"):
            engine.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        elapsed = time.monotonic() - started
        assert timeout_s <= elapsed < timeout_s + grace_s + 5
    finally:
        engine.close()
    _assert_gone(pids)


def test_a_placement_no_node_can_hold_is_refused_at_once(
    cluster: Any, make_checkpoint: Callable[..., Path]
) -> None:
    """TP=4 divides this model (4 KV heads) but needs 4 CPUs on one node; nodes have 2."""
    checkpoint = make_checkpoint("tiny", num_key_value_heads=4)
    tables_before = len(ray.util.placement_group_table())
    started = time.monotonic()
    with pytest.raises(ConfigurationError, match=r"cannot place tensor_parallel_size=4 .*CPU 2"):
        Engine(checkpoint, tensor_parallel_size=4, distributed_executor_backend="ray", **SETTINGS)
    assert time.monotonic() - started < 10
    assert len(ray.util.placement_group_table()) == tables_before  # no group was created


def test_a_placement_that_stays_busy_gives_up_after_the_timeout(
    cluster: Any, checkpoint: Path
) -> None:
    """Feasible, but another placement group holds every CPU: the executor waits at most
    ``placement_timeout_s``, then removes its group and says what is free."""
    from ray.util.placement_group import placement_group

    holder = placement_group([{"CPU": NODE_CPUS}] * 2, strategy="STRICT_SPREAD")
    assert holder.wait(timeout_seconds=30)
    engine = Engine(checkpoint, **SETTINGS)  # only for its resolved RunnerConfig
    config = _runner_config(engine, tensor_parallel_size=2)
    engine.close()
    try:
        started = time.monotonic()
        with pytest.raises(ConfigurationError, match=r"did not place .* within 2 s"):
            RayExecutor(config, placement_timeout_s=2.0)
        assert time.monotonic() - started < 10
        states = [table["state"] for table in ray.util.placement_group_table().values()]
        assert states.count("PENDING") == 0, "the executor left its group waiting"
    finally:
        ray.util.remove_placement_group(holder)


def test_a_given_placement_group_must_hold_every_rank(cluster: Any, checkpoint: Path) -> None:
    """The caller's group: too few bundles, or bundles without the rank's device, are refused
    before any actor starts (an actor that cannot fit a bundle would wait forever)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    engine = Engine(checkpoint, **SETTINGS)  # only for its resolved RunnerConfig
    config = _runner_config(engine, tensor_parallel_size=2)
    engine.close()
    small = placement_group([{"CPU": 1}])
    empty = placement_group([{"CPU": 1}, {"memory": 1024.0}])
    try:
        assert small.wait(timeout_seconds=30) and empty.wait(timeout_seconds=30)
        with pytest.raises(ConfigurationError, match=r"has 1 bundles, .* 2 ranks"):
            RayExecutor(config, placement_group=small)
        with pytest.raises(ConfigurationError, match=r"bundle\(s\) \[1\] .* less than one CPU"):
            RayExecutor(config, placement_group=empty)
    finally:
        remove_placement_group(small)
        remove_placement_group(empty)


def test_splits_the_model_cannot_take_are_refused_before_any_actor(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No cluster needed: the checks run before Ray is imported."""

    def no_ray() -> Any:
        raise AssertionError("Ray was reached")

    monkeypatch.setattr(ray_executor, "import_ray", no_ray)
    with pytest.raises(ConfigurationError, match=r"pipeline_parallel_size=3 exceeds .*=2"):
        Engine(checkpoint, pipeline_parallel_size=3, distributed_executor_backend="ray", **SETTINGS)
    with pytest.raises(ConfigurationError, match=r"num_key_value_heads"):
        Engine(
            checkpoint,
            tensor_parallel_size=4,
            pipeline_parallel_size=2,
            distributed_executor_backend="ray",
            **SETTINGS,
        )
    with pytest.raises(ConfigurationError, match=r"needs distributed_executor_backend='ray'"):
        Engine(checkpoint, pipeline_parallel_size=2, **SETTINGS)


def _runner_config(engine: Engine, **changes: Any) -> Any:
    from dataclasses import replace

    from pagedinfer.adapters.runner_config import RunnerConfig

    base = RunnerConfig(
        model_path=engine.config.model_path,
        device=engine.device,
        dtype=engine.dtype,
        block_size=engine.config.kv_block_size,
        attention_backend=engine.attention_backend,
        max_model_len=engine.max_model_len,
        num_kv_blocks=engine.config.num_kv_blocks,
        distributed_executor_backend="ray",
    )
    return replace(base, **changes)


def _is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_ray_data_replica_runs_a_multi_node_engine(
    cluster: Any, checkpoint: Path, expected: dict[str, list[list[int]]]
) -> None:
    """``pagedinfer.ray.generate`` with a TP=2 engine on the Ray executor per replica: the
    replica reserves no GPU for it and its tokens are one rank's."""
    from pagedinfer.ray import generate
    from pagedinfer.ray.data_parallel import _default_gpus_per_replica

    engine_kwargs = {
        **SETTINGS,
        "device": "auto",  # resolves to the CPU here, like any replica without a GPU
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "ray",
    }
    assert _default_gpus_per_replica(engine_kwargs) == 0
    # On GPUs too: the rank actors reserve theirs; the replica would only hold them idle.
    assert _default_gpus_per_replica({**engine_kwargs, "device": "cuda"}) == 0
    assert (
        _default_gpus_per_replica(
            {
                **engine_kwargs,
                "device": "cuda",
                "tensor_parallel_size": 2,
                "distributed_executor_backend": "mp",
            }
        )
        == 2
    )
    results = generate(
        PROMPTS, checkpoint, GREEDY, num_replicas=1, engine_kwargs=engine_kwargs, batch_size=8
    )
    assert [result.generated_token_ids for result in results] == expected["greedy"]


def test_the_server_engine_drives_ray_ranks_from_its_thread(cluster: Any, checkpoint: Path) -> None:
    """``pagedinfer serve --distributed-executor-backend ray`` builds an AsyncEngine with these
    arguments: its background thread drives the Ray executor; tokens equal one rank's. A
    second engine shares the cluster meanwhile (one TP=2 group per node)."""
    import asyncio

    from pagedinfer.engine.async_engine import AsyncEngine

    prompt = PROMPTS[0]
    with Engine(checkpoint, **SETTINGS) as engine:
        (reference,) = engine.generate([prompt], GREEDY, use_tqdm=False)

    async def serve() -> list[int]:
        async with AsyncEngine(
            checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray", **SETTINGS
        ) as engine:
            final = None
            async for output in engine.generate(prompt, GREEDY):
                final = output
            assert final is not None
            return list(final.outputs[0].token_ids)

    with Engine(
        checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray", **SETTINGS
    ) as other:
        assert asyncio.run(serve()) == reference.outputs[0].token_ids
        (again,) = other.generate([prompt], GREEDY, use_tqdm=False)
        assert again.outputs[0].token_ids == reference.outputs[0].token_ids


def test_structured_outputs_are_sampled_on_the_last_stage(
    cluster: Any, make_checkpoint: Callable[..., Path]
) -> None:
    """PP=2: the last stage's rank 0 samples, with its own grammar compiler built from the
    engine's tokenizer; the constrained outputs equal the in-process engine's."""
    pytest.importorskip("llguidance")
    from pagedinfer import StructuredOutputsParams

    checkpoint = make_checkpoint("tiny", with_tokenizer=True)
    schema = {
        "type": "object",
        "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "maximum": 9}},
        "required": ["k", "v"],
        "additionalProperties": False,
    }
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = [
        SamplingParams(structured_outputs=constraint, max_tokens=40, temperature=0.0),
        SamplingParams(structured_outputs=constraint, max_tokens=40, temperature=1.0, seed=4),
    ]
    prompts = PROMPTS[:2]
    with Engine(checkpoint, **SETTINGS) as engine:
        want = [o.outputs[0].text for o in engine.generate(prompts, params, use_tqdm=False)]
    with Engine(
        checkpoint, pipeline_parallel_size=2, distributed_executor_backend="ray", **SETTINGS
    ) as engine:
        got = [o.outputs[0].text for o in engine.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert all(text.startswith('{"k":') for text in got), got


def test_a_lost_node_raises_worker_died(
    cluster: Any, checkpoint: Path, expected: dict[str, list[list[int]]]
) -> None:
    """PP=2 with a stage on each node; the worker node goes (its raylet and its processes
    killed: a lost machine): the next step raises WorkerDiedError. Last in the module: the
    cluster keeps one node."""
    with pytest.MonkeyPatch.context() as patch:
        group = _spread_over_nodes(patch, 2)
        engine = Engine(
            checkpoint, pipeline_parallel_size=2, distributed_executor_backend="ray", **SETTINGS
        )
    try:
        executor = engine._executor
        assert isinstance(executor, RayExecutor)
        (worker_node,) = cluster.worker_nodes
        assert worker_node.node_id in executor.actor_node_ids
        engine.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        # A lost machine takes its raylet and its processes: the actor processes would
        # otherwise go on serving the driver directly for a while after their raylet died.
        lost = [
            pid
            for pid, node_id in zip(executor.actor_pids, executor.actor_node_ids, strict=True)
            if node_id == worker_node.node_id
        ]
        cluster.remove_node(worker_node, allow_graceful=False)
        for pid in lost:
            os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"rank [01] .* died"):
            engine.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        assert time.monotonic() - started < SETTINGS["worker_timeout_s"]
    finally:
        engine.close()
        ray.util.remove_placement_group(group)


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 30
    while any(_is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_is_running(pid) for pid in pids)
