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

from pagedinfer.errors import EngineDeadError, StepFailedError, WorkerDiedError

__all__ = ["StepFailures", "dead_engine_error", "failed_step_error", "is_fatal"]

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


def dead_engine_error(cause: BaseException, failures: StepFailures) -> EngineDeadError:
    """What every call raises once ``cause`` killed the engine (a fresh error each time)."""
    if isinstance(cause, EngineDeadError):
        # A dead worker says so itself (WorkerDiedError is an EngineDeadError): raise a
        # fresh copy of it, so ``except WorkerTimeoutError`` works and tracebacks do not
        # pile up on one instance.
        copy = type(cause)(*cause.args)
        copy.__cause__ = cause
        return copy
    why = (
        f"{failures.in_a_row} steps failed in a row"
        if failures.in_a_row >= failures.limit
        else "a step failed in a way the engine cannot recover from"
    )
    error = EngineDeadError(
        f"the engine is dead: {why} ({type(cause).__name__}: {cause}). Every "
        "unfinished request was aborted; close this Engine and create a new one."
    )
    error.__cause__ = cause
    return error


def failed_step_error(request_ids: tuple[str, ...], cause: BaseException | None) -> StepFailedError:
    """What a caller waiting for ``request_ids`` raises (``from cause``) after a failed
    step ended them."""
    return StepFailedError(
        f"a step failed ({type(cause).__name__}: {cause}); requests {list(request_ids)} had "
        "a row in it and were aborted. The engine goes on serving other requests.",
        request_ids,
    )
