"""Shared helpers for the runner-level tests: build a runner, drive it with a Scheduler."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

import torch

from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain import BatchPlan, SamplingParams, Scheduler, SchedulerConfig, Sequence

_seq_ids = itertools.count()


def make_runner(checkpoint: Path, **overrides: Any) -> ModelRunner:
    settings: dict[str, Any] = {
        "model_path": str(checkpoint),
        "device": torch.device("cpu"),
        "dtype": torch.float32,
        "block_size": 16,
        "attention_backend": "torch",
        "max_num_seqs": 16,
        "max_num_batched_tokens": 512,
        "max_model_len": 128,
        "num_kv_blocks": 64,
    }
    settings.update(overrides)
    return ModelRunner(RunnerConfig(**settings))


def generate(
    runner: ModelRunner,
    prompts: SequenceABC[list[int]],
    params: SamplingParams | SequenceABC[SamplingParams],
    *,
    enable_prefix_caching: bool = True,
    scheduling_policy: str = "mixed",
    scheduler: Scheduler | None = None,
    plans: list[BatchPlan] | None = None,
) -> tuple[list[list[int]], Scheduler]:
    """Run prompts to completion with the domain Scheduler; completion tokens in input order.

    Every executed plan is appended to ``plans`` when it is given.
    """
    config = runner.config
    if scheduler is None:
        scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=runner.num_kv_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                enable_prefix_caching=enable_prefix_caching,
                scheduling_policy=scheduling_policy,
            )
        )
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    seqs = [
        Sequence(next(_seq_ids), prompt, p) for prompt, p in zip(prompts, per_prompt, strict=True)
    ]
    for seq in seqs:
        scheduler.add(seq)
    while (plan := scheduler.schedule()) is not None:
        if plans is not None:
            plans.append(plan)
        scheduler.postprocess(plan, runner.execute(plan).sampled_token_ids)
    return [seq.completion_token_ids for seq in seqs], scheduler


def random_prompts(
    seed: int, count: int, lengths: tuple[int, int], vocab: int = 512
) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]
