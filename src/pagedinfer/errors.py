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
    "ConfigurationError",
    "EngineClosedError",
    "EngineDeadError",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "KVCacheMemoryError",
    "MissingDependencyError",
    "PagedInferError",
    "UnsupportedModelError",
    "WorkerDiedError",
    "WorkerTimeoutError",
]


class PagedInferError(Exception):
    """Base class of every error pagedinfer raises deliberately."""


class InvalidSamplingParamsError(PagedInferError, ValueError):
    """A ``SamplingParams`` field is out of its allowed range."""


class InvalidRequestError(PagedInferError, ValueError):
    """A request cannot be served: empty prompt, bad token id, too long for ``max_model_len``."""


class ConfigurationError(PagedInferError, ValueError):
    """The engine's settings contradict each other or the chosen backend."""


class UnsupportedModelError(PagedInferError, ValueError):
    """The checkpoint exists but is not a model this library can run, or lacks weights."""


class CheckpointNotFoundError(PagedInferError, FileNotFoundError):
    """The model path does not exist or is not a directory."""


class KVCacheMemoryError(PagedInferError, RuntimeError):
    """Not enough memory for the KV cache (not even a single block)."""


class BlockPoolError(PagedInferError, RuntimeError):
    """The block pool was asked to do something impossible (double free, unknown block).

    The pool checks before it mutates, so after this error its state is unchanged.
    """


class WorkerDiedError(PagedInferError, RuntimeError):
    """A tensor-parallel worker process exited; the engine cannot continue."""


class WorkerTimeoutError(WorkerDiedError):
    """A tensor-parallel worker did not respond within ``worker_timeout_s`` (stopped or hung);
    the engine cannot continue."""


class EngineClosedError(PagedInferError, RuntimeError):
    """The engine was used after ``close()``."""


class MissingDependencyError(PagedInferError, ImportError):
    """An optional feature needs a package that is not installed; the message names the extra."""


class EngineDeadError(PagedInferError, RuntimeError):
    """An ``AsyncEngine`` step failed: every waiting request raises this, and so does every
    later request. The cause is chained (``__cause__``); close the engine and build a new one."""
