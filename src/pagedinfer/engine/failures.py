"""What a failed step means: the requests in it fail, or the whole engine is dead.

When the executor raises while running a step, the engine's own state is intact: the
scheduler made the plan but records nothing until the step's tokens come back, and a plan
that is never recorded is simply planned again (``Scheduler``). What cannot be trusted is
the step's requests (a NaN in one row, a kernel that rejects one request's shape), so the
engine ends the requests that had a row in the step with ``finish_reason="abort"``, raises
:class:`~pagedinfer.errors.StepFailedError` to whoever waits for them, and serves the others.

Some failures leave nothing to serve with. :func:`is_fatal` names them: a tensor-parallel
worker is gone or out of step (:class:`~pagedinfer.errors.WorkerDiedError`, or any failure
with several ranks: the ranks no longer run the same step), or the device reported an error
(``torch.AcceleratorError``, a ``RuntimeError`` saying ``CUDA error``: after a device-side
assert or an illegal memory access the CUDA context is unusable). A step that keeps failing
is fatal too: :class:`StepFailures` counts failed steps in a row and declares the engine dead
at ``max_consecutive_failed_steps``. A dead engine raises
:class:`~pagedinfer.errors.EngineDeadError` from then on (vLLM's policy: the process should
be restarted).
"""

from __future__ import annotations

import torch

from pagedinfer.errors import WorkerDiedError

__all__ = ["StepFailures", "is_fatal"]

# torch >= 2.8 raises device errors as torch.AcceleratorError (a RuntimeError); older
# versions raise a plain RuntimeError whose message starts with "CUDA error".
_ACCELERATOR_ERROR: type[BaseException] | None = getattr(torch, "AcceleratorError", None)


def is_fatal(error: BaseException, *, tensor_parallel: bool) -> bool:
    """Whether a step's failure leaves the engine unable to run any further step."""
    if isinstance(error, WorkerDiedError) or tensor_parallel:
        return True
    if _ACCELERATOR_ERROR is not None and isinstance(error, _ACCELERATOR_ERROR):
        return True
    return isinstance(error, RuntimeError) and "CUDA error" in str(error)


class StepFailures:
    """Failed steps in a row; the engine is dead at ``limit`` of them."""

    __slots__ = ("in_a_row", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row = 0

    def succeeded(self) -> None:
        self.in_a_row = 0

    def failed(self) -> bool:
        """Count a failed step; True if that makes too many in a row (the engine is dead)."""
        self.in_a_row += 1
        return self.in_a_row >= self.limit
