"""A tensor-parallel rank for the CPU (gloo) test: rank 0 schedules and broadcasts plans."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain import BatchPlan, SamplingParams, Scheduler, SchedulerConfig, Sequence


def run_rank(
    rank: int,
    world_size: int,
    rendezvous: str,
    checkpoint: str,
    prompts: list[list[int]],
    max_tokens: int,
    output: str,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size
    )
    try:
        config = RunnerConfig(
            model_path=checkpoint,
            device=torch.device("cpu"),
            dtype=torch.float32,
            block_size=16,
            attention_backend="torch",
            max_num_seqs=8,
            max_model_len=128,
            num_kv_blocks=None,
            tensor_parallel_size=world_size,
        )
        runner = ModelRunner(config, ParallelContext(rank=rank, world_size=world_size))
        if rank == 0:
            _drive(runner, prompts, max_tokens, Path(output))
        else:
            _follow(runner)
        runner.close()
    finally:
        dist.destroy_process_group()


def _drive(runner: ModelRunner, prompts: list[list[int]], max_tokens: int, output: Path) -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=runner.num_kv_blocks, block_size=16, max_model_len=128)
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [Sequence(i, prompt, params) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    while (plan := scheduler.schedule()) is not None:
        dist.broadcast_object_list([plan], src=0)
        scheduler.postprocess(plan, runner.execute(plan).sampled_token_ids)
    dist.broadcast_object_list([None], src=0)
    result = {
        "num_kv_blocks": runner.num_kv_blocks,
        "tokens": [seq.completion_token_ids for seq in seqs],
    }
    output.write_text(json.dumps(result))


def _follow(runner: ModelRunner) -> None:
    while True:
        message: list[BatchPlan | None] = [None]
        dist.broadcast_object_list(message, src=0)
        plan = message[0]
        if plan is None:
            return
        assert runner.execute(plan).sampled_token_ids == []  # only rank 0 samples
