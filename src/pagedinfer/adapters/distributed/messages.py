"""The messages between rank 0 and its workers.

Control messages (rank 0 -> workers, through the shared-memory channel) are tuples whose first
item names the command:

* ``("execute", plan)``: run one step. ``plan`` is the step's ``BatchPlan`` with the
  sampler's lists emptied, because only rank 0 samples (workers still get ``sample_indices``:
  they compute their share of the logits for those rows).
* ``("shutdown",)``: release the model and exit.

Status messages (each worker -> rank 0, through its own pipe) report start-up and failure:
``("started",)`` once the worker is up and about to join the group, ``("ready",
num_kv_blocks)`` once its model runner is built, ``("failed", traceback_text)`` just before
a worker exits on an exception.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Final

from pagedinfer.domain.plan import BatchPlan

__all__ = [
    "EXECUTE",
    "FAILED",
    "READY",
    "SAMPLER_ONLY_FIELDS",
    "SHUTDOWN",
    "STARTED",
    "execute_message",
    "shutdown_message",
]

EXECUTE: Final = "execute"
SHUTDOWN: Final = "shutdown"

STARTED: Final = "started"
READY: Final = "ready"
FAILED: Final = "failed"

SAMPLER_ONLY_FIELDS: Final = (
    "sampled_seq_ids",
    "temperatures",
    "top_ks",
    "top_ps",
    "seeds",
    "sample_steps",
)
"""``BatchPlan`` fields only rank 0's sampler reads; they never cross the channel."""


def execute_message(plan: BatchPlan) -> tuple[str, BatchPlan]:
    """The worker's copy of ``plan``: everything the model reads, nothing the sampler reads."""
    empty: dict[str, Any] = {name: [] for name in SAMPLER_ONLY_FIELDS}
    return (EXECUTE, replace(plan, **empty))


def shutdown_message() -> tuple[str]:
    return (SHUTDOWN,)
