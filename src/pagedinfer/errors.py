"""The exceptions pagedinfer raises on purpose.

Every class also derives from the built-in exception a user would expect (``ValueError`` for
bad input, ``FileNotFoundError`` for a missing checkpoint, ``RuntimeError`` for resource
problems), so ``except ValueError`` keeps working while ``except PagedInferError`` catches all
of them. Messages say the value that was wrong, the limit it broke and, where there is one, the
fix. This module is pure Python: the domain layer may import it.
"""

from __future__ import annotations

__all__ = [
    "BlockPoolError",
    "CheckpointNotFoundError",
    "CollectiveRpcError",
    "ConfigurationError",
    "EngineClosedError",
    "EngineDeadError",
    "InvalidLoRAAdapterError",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "InvalidStructuredOutputError",
    "KVCacheMemoryError",
    "MissingDependencyError",
    "NonFiniteWeightError",
    "PagedInferError",
    "RequestsInFlightError",
    "StepFailedError",
    "UnsupportedModelError",
    "WeightUpdateError",
    "WorkerDiedError",
    "WorkerTimeoutError",
    "install_hint",
]


def install_hint(extra: str | None = None) -> str:
    """The command that installs pagedinfer (with the optional ``extra``) from where users
    are: pagedinfer is not on the package index, so a checkout of its repository (or a wheel
    built there: README.md, Install)."""
    target = "." if extra is None else f"'.[{extra}]'"
    return f"pip install {target} in the pagedinfer checkout (README.md, Install)"


class PagedInferError(Exception):
    """Base class of every error pagedinfer raises deliberately."""


class InvalidSamplingParamsError(PagedInferError, ValueError):
    """A ``SamplingParams`` field is out of its allowed range."""


class InvalidRequestError(PagedInferError, ValueError):
    """A request cannot be served: empty prompt, bad token id, too long for ``max_model_len``."""


class InvalidStructuredOutputError(InvalidRequestError):
    """A structured-output constraint (``StructuredOutputsParams``) is malformed, or its JSON
    schema, regex or grammar does not compile; the message names the problem."""


class InvalidLoRAAdapterError(InvalidRequestError):
    """A LoRA adapter cannot be served: missing files, a rank above ``max_lora_rank``, a
    target module the engine does not adapt, tensors whose shapes do not fit the model."""


class ConfigurationError(PagedInferError, ValueError):
    """The engine's settings contradict each other or the chosen backend."""


class UnsupportedModelError(PagedInferError, ValueError):
    """The checkpoint exists but is not a model this library can run, or lacks weights."""


class NonFiniteWeightError(UnsupportedModelError):
    """A checkpoint tensor holds NaN or infinite values (a corrupt checkpoint); the message
    names the tensor and its file."""


class CheckpointNotFoundError(PagedInferError, FileNotFoundError):
    """The model path does not exist or is not a directory."""


class KVCacheMemoryError(PagedInferError, RuntimeError):
    """Not enough memory for the KV cache (not even a single block)."""


class BlockPoolError(PagedInferError, RuntimeError):
    """The block pool was asked to do something impossible (double free, unknown block).

    The pool checks before it mutates, so after this error its state is unchanged.
    """


class EngineDeadError(PagedInferError, RuntimeError):
    """The engine failed in a way it cannot recover from (a tensor-parallel worker died, the
    device reported an error, or too many steps failed in a row): every waiting request and
    every later call raises this. The cause is chained (``__cause__``); close the engine and
    build a new one."""


class WorkerDiedError(EngineDeadError):
    """A tensor-parallel worker process exited; the engine cannot continue.

    An :class:`EngineDeadError`: a dead worker is the engine's death, so ``except
    EngineDeadError`` catches it too. The engine raises it (a fresh copy, the original
    chained) from the call that met it and from every later call.
    """


class WorkerTimeoutError(WorkerDiedError):
    """A tensor-parallel worker did not respond within ``worker_timeout_s`` (stopped or hung);
    the engine cannot continue."""


class WeightUpdateError(PagedInferError, ValueError):
    """``update_weights`` got a tensor that does not fit the model (a name that maps to no
    parameter, a wrong shape or dtype, a tensor twice, a NaN in a checked tensor, a quantized
    layer); the update was refused before anything was written."""


class CollectiveRpcError(PagedInferError, RuntimeError):
    """A ``collective_rpc`` call raised on a worker (another rank than this process's); the
    message carries the worker's traceback."""


class RequestsInFlightError(PagedInferError, RuntimeError):
    """A call that must run between requests (``update_weights``) found unfinished ones."""


class EngineClosedError(PagedInferError, RuntimeError):
    """The engine was used after ``close()``."""


class MissingDependencyError(PagedInferError, ImportError):
    """An optional feature needs a package that is not installed; the message names the extra."""


class StepFailedError(PagedInferError, RuntimeError):
    """A step failed (the executor raised) and the requests that had a row in it were ended
    with ``finish_reason="abort"``; the engine goes on serving the others.

    ``request_ids`` are the ids (``RequestOutput.request_id``, strings) of the failed requests
    that the raising call owns (its ``generate`` batch, its stream, the ``add_request``
    requests for ``step()``). The executor's exception is chained (``__cause__``).
    """

    def __init__(self, message: str, request_ids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.request_ids = request_ids

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.request_ids))


class EngineStateError(PagedInferError, RuntimeError):
    """A call that the engine's present state does not allow (asleep, paused, busy); the
    message says which state and the call that changes it."""


class EngineSleepingError(EngineStateError):
    """A request reached an engine put to sleep (``sleep()``): call ``wake_up()`` first."""


class EnginePausedError(EngineStateError):
    """The thread that paused the engine (``pause_generation()``) waited for a request: it
    would wait for itself. Call ``resume_generation()`` first (or wait from another thread)."""
