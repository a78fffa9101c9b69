"""CUDA-graph decode on a real GPU, at the model-runner level.

Graphs are captured for every bucket, replaying them gives the eager forward pass's hidden
states step after step while the batch shrinks through buckets and between them (so
padding rows, stale rows and narrower block tables all occur), and no graphs exist with
``enforce_eager`` or a backend that cannot be captured. Run with ``make test-gpu``.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer.adapters.cuda_graph import CudaGraphDecodeRunner, decode_graph_buckets
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain import SamplingParams, Scheduler, SchedulerConfig, Sequence

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 5e-2, "rtol": 5e-2},
}


def cuda_runner(checkpoint: Path, **overrides: Any) -> ModelRunner:
    settings: dict[str, Any] = {
        "model_path": str(checkpoint),
        "device": torch.device("cuda", torch.cuda.current_device()),
        "dtype": torch.float32,
        "block_size": 16,
        "attention_backend": "triton",
        "max_num_seqs": 20,
        "max_num_batched_tokens": 2048,
        # 64-column tables: small buckets split the KV (reserved workspace inside graphs).
        "max_model_len": 1024,
        "num_kv_blocks": 512,
    }
    settings.update(overrides)
    return ModelRunner(RunnerConfig(**settings))


def graphs_of(runner: ModelRunner) -> CudaGraphDecodeRunner:
    graphs = runner.graph_runner
    assert isinstance(graphs, CudaGraphDecodeRunner)
    return graphs


def test_one_graph_per_bucket_and_tables_cover_max_model_len(
    make_checkpoint: Callable[..., Path],
) -> None:
    runner = cuda_runner(make_checkpoint("tiny"), max_num_seqs=20, max_model_len=1000)
    graphs = graphs_of(runner)
    assert graphs.layout.buckets == (1, 2, 4, 8, 16, 20) == tuple(decode_graph_buckets(20))
    assert graphs.layout.table_width == 63  # cdiv(1000, 16)
    assert graphs.static.block_tables.shape == (20, 63)
    runner.close()


@pytest.mark.parametrize(
    "overrides",
    [{"enforce_eager": True}, {"attention_backend": "torch"}],
    ids=["enforce-eager", "torch-backend"],
)
def test_no_graphs_when_eager_or_not_capturable(
    make_checkpoint: Callable[..., Path], overrides: dict[str, Any]
) -> None:
    runner = cuda_runner(make_checkpoint("tiny"), **overrides)
    assert runner.graph_runner is None
    runner.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_replay_matches_the_eager_forward_pass_at_every_step(
    make_checkpoint: Callable[..., Path], dtype: torch.dtype
) -> None:
    checkpoint = make_checkpoint("tiny")
    runner = cuda_runner(checkpoint, dtype=dtype)
    graphs = graphs_of(runner)
    config = runner.config
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=runner.num_kv_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
        )
    )
    rng = random.Random(0)
    # 20 sequences finishing one step apart: decode batches of 20, 19, ..., 1.
    for index in range(20):
        prompt = [rng.randrange(512) for _ in range(rng.randint(1, 200))]
        params = SamplingParams(temperature=0.0, max_tokens=2 + index, ignore_eos=True)
        scheduler.add(Sequence(index, prompt, params))
    batch_sizes = []
    while (plan := scheduler.schedule()) is not None:
        if not plan.is_prefill:
            assert graphs.can_replay(plan)
            batch_sizes.append(plan.num_seqs)
            inputs = runner.prepare(plan)  # written straight into the graph's static inputs
            assert inputs.graph_batch is not None
            with torch.inference_mode():
                eager = runner.model(inputs.input_ids, inputs.positions, inputs.meta).float()
                replayed = graphs.replay(inputs.graph_batch, plan.num_seqs).float()
            assert replayed.shape == eager.shape == (plan.num_seqs, runner.model_config.hidden_size)
            torch.testing.assert_close(replayed, eager, **TOLERANCE[dtype])
        scheduler.postprocess(plan, runner.execute(plan).sampled_token_ids)
    assert batch_sizes == list(range(20, 0, -1))
    runner.close()


def test_prefill_and_oversized_batches_do_not_replay(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Batches above the largest graph happen when max_num_seqs > MAX_GRAPH_BATCH_SIZE (512):
    # shrink that limit to 4 rather than run 513 sequences. The scheduler and the runner
    # agree on max_num_seqs (the sampling table has one slot per running sequence).
    monkeypatch.setattr("pagedinfer.adapters.cuda_graph.MAX_GRAPH_BATCH_SIZE", 4)
    runner = cuda_runner(make_checkpoint("tiny"), max_num_seqs=6)
    graphs = graphs_of(runner)
    assert graphs.layout.buckets == (1, 2, 4)
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=512, block_size=16, max_num_seqs=6, max_model_len=1024)
    )
    for index in range(6):
        params = SamplingParams(temperature=0.0, max_tokens=2 + index, ignore_eos=True)
        scheduler.add(Sequence(index, [index + 1] * 30, params))
    replays_by_batch = {}
    while (plan := scheduler.schedule()) is not None:
        before = graphs.num_replays
        scheduler.postprocess(plan, runner.execute(plan).sampled_token_ids)
        replays_by_batch[(plan.is_prefill, plan.num_seqs)] = graphs.num_replays - before
    # Decode batches of 6 and 5 run eagerly, 4 and fewer replay; prefill never does.
    assert replays_by_batch == {
        (True, 6): 0,
        (False, 6): 0,
        (False, 5): 0,
        (False, 4): 1,
        (False, 3): 1,
        (False, 2): 1,
        (False, 1): 1,
    }
    runner.close()


def test_close_releases_graph_memory(make_checkpoint: Callable[..., Path]) -> None:
    checkpoint = make_checkpoint("tiny")
    # A first runner creates what lives as long as the process (cuBLAS workspaces of the
    # capture stream, Triton's compiled kernels); the second must give back all it took.
    cuda_runner(checkpoint, max_num_seqs=64).close()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    runner = cuda_runner(checkpoint, max_num_seqs=64)
    assert torch.cuda.memory_allocated() > baseline
    runner.close()
    del runner
    gc.collect()
    torch.cuda.synchronize()
    # The model, the KV cache, the static inputs and every graph's pool are gone.
    assert torch.cuda.memory_allocated() - baseline < 1 << 20
