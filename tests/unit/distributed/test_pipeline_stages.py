"""Pipeline stages without Ray: the layer split, what a stage holds, and stage runners chained
in one process equal one whole-model runner token for token.

The chain hands each stage's ``IntermediateTensors`` to the next as the Ray executor does
(through the CPU), with the domain scheduler driving it; the Ray tests
(``test_ray_executor.py``) run the same stages as actors on two simulated nodes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.unit.adapters.runner_helpers import generate
from tests.unit.distributed.tp_helpers import shared_prefix_prompts

from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.distributed.pipeline import (
    IntermediateTensors,
    PipelineStage,
    pipeline_stages,
)
from pagedinfer.adapters.distributed.stage_runner import StageRunner
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain import BatchPlan, SamplingParams
from pagedinfer.domain.step_output import StepOutput
from pagedinfer.errors import ConfigurationError

SETTINGS: dict[str, Any] = {
    "device": torch.device("cpu"),
    "dtype": torch.float32,
    "block_size": 16,
    "attention_backend": "torch",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 48,
    "max_model_len": 128,
    "num_kv_blocks": 12,  # the prompts below preempt each other
}


@pytest.mark.parametrize(
    ("layers", "stages", "sizes"),
    [(2, 2, [1, 1]), (5, 2, [3, 2]), (7, 3, [2, 3, 2]), (8, 3, [3, 3, 2]), (64, 2, [32, 32])],
)
def test_layers_split_evenly_the_remainder_going_backwards_from_the_last_but_one(
    layers: int, stages: int, sizes: list[int]
) -> None:
    split = pipeline_stages(layers, stages)
    assert [stage.end - stage.start for stage in split] == sizes
    assert split[0].start == 0 and split[-1].end == layers
    assert all(a.end == b.start for a, b in itertools.pairwise(split))
    assert split[0].is_first and split[-1].is_last and not split[0].is_last


def test_more_stages_than_layers_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"pipeline_parallel_size=3 exceeds .*=2"):
        pipeline_stages(2, 3)


class PipelineChain:
    """Stage runners of one model in this process, run one after the other per step."""

    def __init__(self, config: RunnerConfig, stages: list[PipelineStage]) -> None:
        self.config = config
        self.runners = [StageRunner(config, ParallelContext(stage=stage)) for stage in stages]
        self.num_kv_blocks = self.runners[0].num_kv_blocks
        self.boundary_bytes: list[int] = []

    def execute(self, plan: BatchPlan) -> StepOutput:
        handed: IntermediateTensors | None = None
        for runner in self.runners[:-1]:
            out = runner.execute_stage(plan, handed)
            assert isinstance(out, IntermediateTensors)
            assert out.hidden.device.type == "cpu"
            self.boundary_bytes.append(out.nbytes)
            handed = out
        output = self.runners[-1].execute_stage(plan, handed)
        assert isinstance(output, StepOutput)
        return output


@pytest.fixture(scope="module")
def three_layers(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", num_hidden_layers=3, tie_word_embeddings=False)


@pytest.mark.parametrize(("num_stages", "tied"), [(2, True), (3, False)])
def test_chained_stages_equal_the_whole_model(
    make_checkpoint: Callable[..., Path], three_layers: Path, num_stages: int, tied: bool
) -> None:
    checkpoint = make_checkpoint("tiny", num_hidden_layers=3) if tied else three_layers
    config = RunnerConfig(model_path=str(checkpoint), **SETTINGS)
    prompts = shared_prefix_prompts(seed=7, count=5)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0.8, seed=10 + i, max_tokens=16, ignore_eos=True)
        for i in range(3)
    ]
    whole, scheduler = generate(ModelRunner(config), prompts, params)
    assert scheduler.stats().num_preemptions > 0, "the workload lost its point"
    chain = PipelineChain(config, pipeline_stages(3, num_stages))
    staged, _ = generate(chain, prompts, params)  # type: ignore[arg-type]
    assert staged == whole
    # What crosses a boundary: hidden states and residual, float32, per token.
    hidden = chain.runners[0].model_config.hidden_size
    assert all(size % (2 * hidden * 4) == 0 for size in chain.boundary_bytes)


def test_a_stage_holds_only_its_layers_and_cache(three_layers: Path) -> None:
    config = RunnerConfig(model_path=str(three_layers), **SETTINGS)
    whole = ModelRunner(config)
    first, last = pipeline_stages(3, 2)
    head = StageRunner(config, ParallelContext(stage=first))
    tail = StageRunner(config, ParallelContext(stage=last))
    names = {name for name, _ in head.model.named_parameters()}
    assert any(name.startswith("model.layers.1.") for name in names)
    assert not any(
        name.startswith(("model.layers.2.", "lm_head.", "model.norm.")) for name in names
    )
    names = {name for name, _ in tail.model.named_parameters()}
    assert not any(name.startswith(("model.layers.0.", "model.embed_tokens.")) for name in names)
    total = sum(p.numel() for p in whole.model.parameters())
    assert sum(p.numel() for r in (head, tail) for p in r.model.parameters()) == total
    # KV cache: one slice per layer the stage holds, the same number of blocks everywhere.
    assert head.kv_cache.shape[1] == 2 and tail.kv_cache.shape[1] == 1
    assert whole.kv_cache.shape[1] == 3
    assert head.num_kv_blocks == tail.num_kv_blocks == whole.num_kv_blocks


def test_an_fp8_cache_is_refused_with_stages(three_layers: Path) -> None:
    config = RunnerConfig(model_path=str(three_layers), kv_cache_dtype="fp8", **SETTINGS)
    with pytest.raises(ConfigurationError, match="kv_cache_dtype='fp8' is not supported"):
        StageRunner(config, ParallelContext(stage=pipeline_stages(3, 2)[0]))


def test_the_local_executor_refuses_stages(three_layers: Path) -> None:
    from pagedinfer.adapters.executor import create_executor

    config = RunnerConfig(model_path=str(three_layers), pipeline_parallel_size=2, **SETTINGS)
    with pytest.raises(ConfigurationError, match="needs distributed_executor_backend='ray'"):
        create_executor(config)
