"""ModelRunner driven by the domain Scheduler: token-exact greedy parity with transformers'
``generate`` across block sizes, prefix caching, chunked prefill and preemption; seeded
sampling; KV-cache layout and sizing; lifecycle."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hf_reference import hf_greedy
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.domain import BatchPlan, SamplingParams, Scheduler, SchedulerConfig, Sequence
from pagedinfer.errors import ConfigurationError, EngineClosedError

from .runner_helpers import generate, make_runner, random_prompts

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def mixed_prompts() -> list[list[int]]:
    """Different lengths, two sharing a 40-token prefix, one of a single token."""
    prompts = random_prompts(seed=11, count=4, lengths=(2, 45))
    shared = random_prompts(seed=12, count=1, lengths=(40, 40))[0]
    return [*prompts, [*shared, 7, 8, 9], [*shared, 1], [42]]


def assert_matches_transformers(
    checkpoint: Path, prompts: list[list[int]], outputs: list[list[int]]
) -> None:
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == hf_greedy(checkpoint, prompt, MAX_TOKENS), f"prompt of {len(prompt)}"


@pytest.mark.parametrize(
    ("block_size", "num_kv_blocks", "max_batched", "prefix_caching", "policy"),
    [
        (16, 64, 512, True, "mixed"),  # roomy pool, whole prompts in one step
        (16, 64, 512, False, "mixed"),
        (16, 9, 40, True, "mixed"),  # chunked prefill and preemption with a cache
        (32, 5, 24, False, "prefill_first"),  # chunked prefill and preemption without one
        (256, 2, 512, True, "mixed"),  # one block per sequence
    ],
)
def test_greedy_matches_transformers(
    tiny_checkpoint: Path,
    block_size: int,
    num_kv_blocks: int,
    max_batched: int,
    prefix_caching: bool,
    policy: str,
) -> None:
    prompts = mixed_prompts()
    runner = make_runner(
        tiny_checkpoint,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=max_batched,
        max_model_len=min(128, num_kv_blocks * block_size),
    )
    plans: list[BatchPlan] = []
    outputs, scheduler = generate(
        runner,
        prompts,
        GREEDY,
        enable_prefix_caching=prefix_caching,
        scheduling_policy=policy,
        plans=plans,
    )
    assert_matches_transformers(tiny_checkpoint, prompts, outputs)
    # The configuration really exercised what it is meant to.
    if num_kv_blocks * block_size < 200:  # the pool cannot hold every sequence at once
        assert scheduler.stats().num_preemptions > 0
    if max_batched < 45:  # some prompt is longer than a step: some chunk samples nothing
        assert any(plan.is_prefill and plan.num_samples < plan.num_seqs for plan in plans)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU run of the Triton kernels needs the interpreter",
)
def test_triton_backend_in_the_model_path(tiny_checkpoint: Path) -> None:
    """The model path with the Triton kernels (interpreted on CPU): same greedy tokens."""
    prompts = [[*mixed_prompts()[4], 5], [3, 1, 4, 1, 5]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runner = make_runner(tiny_checkpoint, attention_backend="triton", max_num_batched_tokens=32)
    outputs, _ = generate(runner, prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == hf_greedy(tiny_checkpoint, prompt, 4)


def test_warm_prefix_cache_reuses_blocks_and_matches(tiny_checkpoint: Path) -> None:
    prompts = mixed_prompts()
    runner = make_runner(tiny_checkpoint, block_size=16, num_kv_blocks=64)
    _, scheduler = generate(runner, prompts, GREEDY)
    hits_before = scheduler.pool.stats().prefix_hit_tokens
    outputs, _ = generate(runner, prompts, GREEDY, scheduler=scheduler)
    assert scheduler.pool.stats().prefix_hit_tokens > hits_before
    assert_matches_transformers(tiny_checkpoint, prompts, outputs)


def test_seeded_requests_are_reproducible_regardless_of_batch(tiny_checkpoint: Path) -> None:
    prompt = random_prompts(seed=21, count=1, lengths=(20, 20))[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    others = random_prompts(seed=22, count=3, lengths=(5, 40))
    other_params = [
        SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, seed=9, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    ]
    alone, _ = generate(make_runner(tiny_checkpoint, seed=1), [prompt], seeded)
    crowd, _ = generate(
        make_runner(tiny_checkpoint, seed=2), [*others, prompt], [*other_params, seeded]
    )
    # A small pool preempts and recomputes; the seeded draws must not notice.
    tight = make_runner(tiny_checkpoint, num_kv_blocks=8, max_model_len=64, seed=3)
    squeezed, scheduler = generate(tight, [*others, prompt], [*other_params, seeded])
    assert scheduler.stats().num_preemptions > 0
    assert alone[0] == crowd[-1] == squeezed[-1]
    assert len(set(alone[0])) > 1  # really sampled, not stuck on one token


def test_unseeded_sampling_follows_the_runner_seed(tiny_checkpoint: Path) -> None:
    prompts = random_prompts(seed=31, count=3, lengths=(5, 20))
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    first, _ = generate(make_runner(tiny_checkpoint, seed=5), prompts, params)
    second, _ = generate(make_runner(tiny_checkpoint, seed=5), prompts, params)
    other, _ = generate(make_runner(tiny_checkpoint, seed=6), prompts, params)
    assert first == second
    assert first != other


def test_partial_prefill_chunk_samples_nothing(tiny_checkpoint: Path) -> None:
    runner = make_runner(tiny_checkpoint, max_num_batched_tokens=16)
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=runner.num_kv_blocks,
            block_size=16,
            max_num_batched_tokens=16,
            max_model_len=128,
        )
    )
    scheduler.add(Sequence(0, list(range(40)), GREEDY))
    plan = scheduler.schedule()
    assert plan is not None and plan.num_samples == 0
    assert runner.execute(plan).sampled_token_ids == []


def test_kv_cache_layout_and_per_layer_views(tiny_checkpoint: Path) -> None:
    runner = make_runner(tiny_checkpoint, block_size=32, num_kv_blocks=5)
    assert runner.num_kv_blocks == 5
    # [2, layers, blocks, block_size, kv_heads, head_dim]
    assert runner.kv_cache.shape == (2, 2, 5, 32, 2, 32)
    assert runner.kv_cache.dtype is torch.float32
    layers = runner.model.attention_layers()
    assert len(layers) == 2
    for index, layer in enumerate(layers):
        assert layer.k_cache.data_ptr() == runner.kv_cache[0, index].data_ptr()
        assert layer.v_cache.data_ptr() == runner.kv_cache[1, index].data_ptr()


def test_cpu_cache_is_sized_from_memory_and_capped(tiny_checkpoint: Path) -> None:
    runner = make_runner(
        tiny_checkpoint, num_kv_blocks=None, max_num_seqs=3, max_model_len=100, block_size=16
    )
    # Plenty of RAM for a tiny model: capped at what 3 sequences of 100 tokens could use.
    assert runner.num_kv_blocks == 3 * 7
    assert runner.kv_cache.shape[2] == 3 * 7


def test_bad_settings_are_refused(tiny_checkpoint: Path) -> None:
    with pytest.raises(ConfigurationError, match="num_kv_blocks=0"):
        make_runner(tiny_checkpoint, num_kv_blocks=0)
    with pytest.raises(ConfigurationError, match="max_position_embeddings=4096"):
        make_runner(tiny_checkpoint, max_model_len=5000)
    with pytest.raises(ConfigurationError, match="'mystery'"):
        make_runner(tiny_checkpoint, attention_backend="mystery")


def test_close_is_idempotent_and_final(tiny_checkpoint: Path) -> None:
    runner: ModelRunner = make_runner(tiny_checkpoint)
    scheduler = Scheduler(SchedulerConfig(num_blocks=64, block_size=16, max_model_len=128))
    scheduler.add(Sequence(0, [1, 2, 3], GREEDY))
    plan = scheduler.schedule()
    assert plan is not None
    assert len(runner.execute(plan).sampled_token_ids) == 1
    runner.close()
    runner.close()
    with pytest.raises(EngineClosedError, match="model runner was used after close"):
        runner.execute(plan)
