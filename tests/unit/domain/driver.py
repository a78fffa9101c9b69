"""Drive a Scheduler without a model: a fake sampler and a step loop (no GPU, no torch)."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from pagedinfer.domain import BatchPlan, Scheduler
from pagedinfer.domain import Sequence as Seq

Sampler = Callable[[Sequence[int]], int]


def hash_sampler(vocab: int = 1000) -> Sampler:
    """Next token = a deterministic function of the whole token history.

    Outputs therefore depend only on what the sequence has seen, never on batching,
    chunking, preemption or prefix caching: any run must reproduce a reference run.
    """

    def sample(token_ids: Sequence[int]) -> int:
        return xxhash.xxh64_intdigest(array("q", token_ids).tobytes()) % vocab

    return sample


def constant_sampler(token_id: int) -> Sampler:
    return lambda _tokens: token_id


@dataclass
class Step:
    plan: BatchPlan
    updated: list[Seq]


def step(scheduler: Scheduler, sampler: Sampler) -> Step | None:
    """One schedule → fake execute → postprocess round; ``None`` if nothing was scheduled."""
    plan = scheduler.schedule()
    if plan is None:
        return None
    sampled = []
    for seq_id in plan.sampled_seq_ids:
        seq = scheduler.get(seq_id)
        assert seq is not None
        sampled.append(sampler(seq.token_ids))
    return Step(plan, scheduler.postprocess(plan, sampled))


def run_to_completion(
    scheduler: Scheduler, sampler: Sampler, *, max_steps: int = 10_000
) -> list[BatchPlan]:
    plans: list[BatchPlan] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return plans
        result = step(scheduler, sampler)
        assert result is not None, "unfinished requests but nothing schedulable"
        plans.append(result.plan)
    raise AssertionError(f"not finished after {max_steps} steps")
