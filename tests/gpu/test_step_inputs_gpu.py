"""One host-to-device copy per step and one device-to-host read, on a real GPU.

``torch.profiler`` records the device's memcpy operations during ``ModelRunner.execute``: a
prefill step, decode steps replayed from CUDA graphs and eager decode steps must each show
exactly one host-to-device copy (the packed step) and one device-to-host copy (the sampled
ids), whatever the sampling parameters (seeded rows included). Run with ``make test-gpu``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain import SamplingParams, Scheduler, SchedulerConfig, Sequence

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_runner(checkpoint: Path, **overrides: Any) -> ModelRunner:
    settings: dict[str, Any] = {
        "model_path": str(checkpoint),
        "device": torch.device("cuda", torch.cuda.current_device()),
        "dtype": torch.bfloat16,
        "block_size": 16,
        "attention_backend": "triton",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "max_model_len": 256,
        "num_kv_blocks": 128,
    }
    settings.update(overrides)
    return ModelRunner(RunnerConfig(**settings))


def copies(runner: ModelRunner, plan: Any) -> tuple[int, int, list[int]]:
    """(host-to-device, device-to-host) memcpy operations of one execute, and its tokens."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tokens = runner.execute(plan).sampled_token_ids
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return (
        sum("HtoD" in name for name in names),
        sum("DtoH" in name for name in names),
        tokens,
    )


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_one_copy_each_way_per_step(
    make_checkpoint: Callable[..., Path], enforce_eager: bool
) -> None:
    runner = cuda_runner(make_checkpoint("tiny"), enforce_eager=enforce_eager)
    assert (runner.graph_runner is None) == enforce_eager
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=16, max_model_len=256)
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True),
    ]
    for index, p in enumerate(params):
        scheduler.add(Sequence(index, [index + 3] * (20 + 17 * index), p))
    seen = {True: 0, False: 0}
    while (plan := scheduler.schedule()) is not None:
        to_device, to_host, tokens = copies(runner, plan)
        assert (to_device, to_host) == (1, 1), (plan.is_prefill, plan.num_seqs)
        seen[plan.is_prefill] += 1
        scheduler.postprocess(plan, tokens)
    assert seen[True] >= 1 and seen[False] >= 5
    runner.close()
