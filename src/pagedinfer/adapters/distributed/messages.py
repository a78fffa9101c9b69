"""The messages between rank 0 and its workers.

Control messages (rank 0 -> workers, through the shared-memory channel) are tuples whose first
item names the command:

* ``("execute", plan)``: run one step. ``plan`` is the step's ``BatchPlan`` without its
  sampling fields (slots and sampling-table deltas), because only rank 0 samples (workers
  still get ``sample_indices``: they compute their share of the logits for those rows).
* ``("sleep", level)`` / ``("wake_up", tags)``: sleep mode (``adapters/sleep_mode.py``).
* ``("rpc", payload)``: ``collective_rpc`` between steps (``adapters/collective_rpc.py``;
  ``payload``: the pickled method, arguments and keyword arguments); the worker answers
  ``("rpc_result", ok, value)`` on its status pipe: ``ok`` and the method's result, or not
  ``ok`` and the error's traceback text (the worker keeps serving).
* ``("shutdown",)``: release the model and exit.

Status messages (each worker -> rank 0, through its own pipe) report start-up and failure:
``("started",)`` once the worker is up and about to join the group, ``("ready",
num_kv_blocks, kv_groups)`` once its model runner is built, ``("failed", traceback_text)``
just before a worker exits on an exception.
"""

from __future__ import annotations

from array import array
from dataclasses import replace
from typing import Any, Final

from pagedinfer.domain.plan import BatchPlan, NewRequest
from pagedinfer.domain.sampling import SamplingParams

__all__ = [
    "EXECUTE",
    "FAILED",
    "READY",
    "RPC",
    "RPC_RESULT",
    "SAMPLER_ONLY_FIELDS",
    "SHUTDOWN",
    "SLEEP",
    "STARTED",
    "WAKE_UP",
    "execute_message",
    "rpc_message",
    "shutdown_message",
    "sleep_message",
    "wake_up_message",
]

EXECUTE: Final = "execute"
SLEEP: Final = "sleep"
WAKE_UP: Final = "wake_up"
SHUTDOWN: Final = "shutdown"
RPC: Final = "rpc"

STARTED: Final = "started"
READY: Final = "ready"
FAILED: Final = "failed"
RPC_RESULT: Final = "rpc_result"

SAMPLER_ONLY_FIELDS: Final = (
    "sample_slots",
    "released_slots",
    "new_requests",
    "forks",
    "prompt_logprob_targets",
)
"""``BatchPlan`` fields only rank 0's sampler reads; they never cross the channel, but for
LoRA's share of the deltas (:func:`execute_message`)."""


def execute_message(plan: BatchPlan) -> tuple[str, BatchPlan]:
    """The worker's copy of ``plan``: everything the model reads, nothing the sampler reads.

    LoRA is the model's business: new requests that run with an adapter cross as their
    adapter only (default parameters, no prompt), and with them the released slots, so that
    each rank maps the same rows to the same adapters (:mod:`pagedinfer.adapters.lora`)."""
    adapters = tuple(
        NewRequest(request.seq_id, request.slot, _NO_PARAMS, 0, lora=request.lora)
        for request in plan.new_requests
        if request.lora is not None
    )
    empty: dict[str, Any] = {
        "sample_slots": array("i"),
        "released_slots": plan.released_slots,  # a few ints: where adapters' rows end
        "new_requests": adapters,
        "forks": (),
        "prompt_logprob_targets": array("q"),
    }
    assert set(empty) == set(SAMPLER_ONLY_FIELDS)
    return (EXECUTE, replace(plan, **empty))


_NO_PARAMS = SamplingParams()


def shutdown_message() -> tuple[str]:
    return (SHUTDOWN,)


def sleep_message(level: int) -> tuple[str, int]:
    return (SLEEP, level)


def wake_up_message(tags: list[str] | None) -> tuple[str, list[str] | None]:
    return (WAKE_UP, tags)


def rpc_message(payload: bytes) -> tuple[str, bytes]:
    return (RPC, payload)
