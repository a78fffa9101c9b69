"""The host KV tier (``kv_offloading_size``) through the engine, on the CPU.

A device pool of 8 blocks of 16 tokens (two 60-token requests fill it) behind a host tier:
outputs must be token-identical with and without the tier (greedy, seeded sampling, n > 1,
preemption), a prefix evicted from the device is found in the tier and not recomputed, a tier
of one block works, an abort while a copy is in flight frees everything, and bad options are
refused with a clear error.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import Engine, SamplingParams
from pagedinfer.errors import ConfigurationError

BLOCK = 16
TIER_GIB = 0.001  # 1 MiB: 65 blocks of the tiny model (16 KiB each in float32)
ONE_BLOCK_GIB = 16384 / (1 << 30)


def _engine(checkpoint: Path, tier: float | None, **options: Any) -> Engine:
    return Engine(
        str(checkpoint),
        device="cpu",
        kv_block_size=BLOCK,
        num_kv_blocks=8,
        max_model_len=128,
        max_num_batched_tokens=64,
        kv_offloading_size=tier,
        **options,
    )


@pytest.fixture(scope="module")
def engines(tiny_checkpoint: Path) -> Iterator[Callable[[float | None], Engine]]:
    made: dict[float | None, Engine] = {}

    def get(tier: float | None) -> Engine:
        if tier not in made:
            made[tier] = _engine(tiny_checkpoint, tier)
        engine = made[tier]
        engine.reset_prefix_cache()
        return engine

    yield get
    for engine in made.values():
        engine.close()


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(200) for _ in range(48)]
    return [shared + [rng.randrange(200) for _ in range(rng.randint(4, 30))] for _ in range(count)]


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    outputs = engine.generate(prompts, params, use_tqdm=False)
    return [[completion.token_ids for completion in out.outputs] for out in outputs]


def test_a_prefix_evicted_from_the_device_comes_back_from_the_tier(
    engines: Callable[[float | None], Engine],
) -> None:
    rng = random.Random(1)
    first, second, third = ([rng.randrange(200) for _ in range(100)] for _ in range(3))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for tier in (None, TIER_GIB):
        engine = engines(tier)
        for prompt in (first, second, third):  # the second and third evict the first
            engine.generate([prompt], params, use_tqdm=False)
        (again,) = engine.generate([[*first, 7, 8]], params, use_tqdm=False)
        results[tier] = (again.num_cached_tokens, again.outputs[0].token_ids)
        stats = engine.stats().host_tier
        if tier is None:
            assert stats is None
        else:
            assert stats is not None and stats.blocks_copied_in >= 6 and stats.hit_tokens >= 96
            assert stats.bytes_used <= stats.num_blocks * stats.block_bytes
    assert results[None][0] == 0  # evicted: recomputed
    assert results[TIER_GIB][0] == 96  # six full blocks copied back in, not recomputed
    assert results[TIER_GIB][1] == results[None][1]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=10, ignore_eos=True),
    ],
    ids=["greedy", "seeded", "n2"],
)
def test_outputs_are_identical_with_and_without_the_tier(
    engines: Callable[[float | None], Engine], params: SamplingParams
) -> None:
    prompts = _prompts(10)
    without = engines(None)
    baseline = _run(without, prompts, params)
    assert without.stats().num_preemptions > 0  # the pool is too small for the batch
    with_tier = engines(TIER_GIB)
    for _ in range(2):  # the second round finds the shared prefix in the tier or the pool
        assert _run(with_tier, prompts, params) == baseline
    stats = with_tier.stats().host_tier
    assert stats is not None and stats.blocks_copied_out > 0


def test_async_scheduling_gives_the_same_outputs(
    engines: Callable[[float | None], Engine], tiny_checkpoint: Path
) -> None:
    prompts = _prompts(8, seed=6)
    params = SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=8, ignore_eos=True)
    baseline = _run(engines(None), prompts, params)
    with _engine(tiny_checkpoint, TIER_GIB, async_scheduling=True) as engine:
        assert _run(engine, prompts, params) == baseline
        assert _run(engine, prompts, params) == baseline
        stats = engine.stats().host_tier
        assert stats is not None and stats.blocks_copied_in > 0


def test_a_tier_of_one_block_stays_within_it(tiny_checkpoint: Path) -> None:
    prompts = _prompts(6, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with _engine(tiny_checkpoint, None) as engine:
        baseline = _run(engine, prompts, params)
    with _engine(tiny_checkpoint, ONE_BLOCK_GIB) as engine:
        assert _run(engine, prompts, params) == baseline
        assert _run(engine, prompts, params) == baseline
        stats = engine.stats().host_tier
        assert stats is not None and stats.num_blocks == 1
        assert stats.bytes_used <= stats.block_bytes
        assert stats.blocks_copied_out > 1  # the one slot was reused


def test_an_abort_while_blocks_are_copied_in_frees_everything(
    engines: Callable[[float | None], Engine],
) -> None:
    engine = engines(TIER_GIB)
    rng = random.Random(4)
    first, second, third = ([rng.randrange(200) for _ in range(100)] for _ in range(3))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for prompt in (first, second, third):
        engine.generate([prompt], params, use_tqdm=False)
    scheduler = engine.scheduler
    request_id = engine.add_request([*first, 1, 2, 3], params)
    # Admit it without recording the plan that copies its blocks in: the copy is in flight.
    plan = scheduler.schedule()
    assert plan is not None and plan.kv_copies_in and scheduler.loading_seq_ids
    assert engine.abort(request_id)
    assert not scheduler.loading_seq_ids
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks
    tier = scheduler.host_tier
    assert tier is not None
    tier.check_integrity()
    assert tier.stats().num_copying_in == 0  # the blocks are resident again
    (again,) = engine.generate([[*first, 9]], params, use_tqdm=False)
    assert again.num_cached_tokens == 96  # still found in the tier


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_offloading_size": -1.0}, "expected GiB of host memory > 0"),
        ({"kv_offloading_size": 1.0, "enable_prefix_caching": False}, "enable_prefix_caching"),
        ({"kv_offloading_backend": "native"}, "needs kv_offloading_size"),
        ({"kv_offloading_size": 1.0, "kv_offloading_backend": "lmcache"}, "'native'"),
        ({"kv_offloading_size": 1e-9}, "would hold no block"),
    ],
)
def test_bad_tier_options_are_refused(
    tiny_checkpoint: Path, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Engine(
            str(tiny_checkpoint),
            device="cpu",
            kv_block_size=BLOCK,
            num_kv_blocks=8,
            max_model_len=128,
            **options,
        )


def test_the_tier_is_in_the_prometheus_metrics(
    engines: Callable[[float | None], Engine],
) -> None:
    pytest.importorskip("prometheus_client")
    from pagedinfer.serving.metrics import ServerMetrics

    engine = engines(TIER_GIB)
    engine.generate(_prompts(4, seed=8), SamplingParams(max_tokens=2), use_tqdm=False)
    text = ServerMetrics().render(engine.stats()).decode()
    for name in (
        "host_kv_blocks",
        "host_kv_bytes_used",
        "host_kv_hit_tokens_total",
        "host_kv_blocks_copied_out_total",
        "host_kv_blocks_copied_in_total",
        "host_kv_load_wait_steps_total",
    ):
        assert f"{name} " in text or f"{name}{{" in text, name
    assert "host_kv_blocks" not in ServerMetrics().render(engines(None).stats()).decode()
