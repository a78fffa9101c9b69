"""``collective_rpc``: one call run on every rank's runner, results gathered in rank order.

vLLM's name and meaning: ``method`` is either the name of a method of the rank's worker (here
the rank's :class:`~pagedinfer.adapters.model_runner.ModelRunner`, whose ``model`` is the
``torch.nn.Module`` holding this rank's shard of the weights) or a callable that receives the
runner first: ``method(runner, *args, **kwargs)``. The executors decide where it runs: in
this process (one rank), on rank 0 here and through the control channel on the spawned
workers (``mp``: ``method``, ``args`` and the results are pickled, so a callable must be a
module-level function), or on the Ray actors (``ray``: Ray pickles it, lambdas included).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any

from pagedinfer.errors import ConfigurationError

__all__ = ["RpcMethod", "call_on_runner", "pack_call", "unpack_call"]

RpcMethod = str | Callable[..., Any]


def call_on_runner(
    runner: object,
    method: RpcMethod,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """Run ``method`` on ``runner`` (see the module docstring) and return its result."""
    if isinstance(method, str):
        bound = getattr(runner, method, None)
        if method.startswith("__") or not callable(bound):
            raise ConfigurationError(
                f"collective_rpc: the worker ({type(runner).__name__}) has no method "
                f"{method!r}: pass the name of one of its methods, or a function that takes "
                "the worker first (function(worker, *args, **kwargs))."
            )
        return bound(*args, **(kwargs or {}))
    if not callable(method):
        raise ConfigurationError(
            f"collective_rpc: method must be a method name or a callable, got {method!r}."
        )
    return method(runner, *args, **(kwargs or {}))


def pack_call(method: RpcMethod, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bytes:
    """The call, pickled once for the worker processes; :class:`ConfigurationError` if it
    cannot be."""
    try:
        return pickle.dumps((method, args, dict(kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise ConfigurationError(
            f"collective_rpc: {method!r} or its arguments cannot be pickled ({error}): with "
            "tensor_parallel_size > 1 the call travels to the worker processes, so pass a "
            "method name or a module-level function (not a lambda or a closure), and "
            "picklable arguments."
        ) from error


def unpack_call(payload: bytes) -> tuple[RpcMethod, tuple[Any, ...], dict[str, Any]]:
    """The worker's side of :func:`pack_call`."""
    method, args, kwargs = pickle.loads(payload)
    return method, tuple(args), dict(kwargs)
