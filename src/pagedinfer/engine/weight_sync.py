"""The engine's hooks for training loops: ``update_weights``, ``update_weights_from_path``,
``collective_rpc`` (docs/rl.md).

:class:`WeightSync` is a base class of :class:`~pagedinfer.engine.engine.Engine` (and so of
``LLM``); it reads the engine's lock, executor and request table.

When they run
-------------
Between steps: each call takes the engine's lock, waits for a step another thread is running
to end (under async scheduling, lands the step in flight first), and holds the lock until it
returns, so no step runs meanwhile; a request submitted from another thread waits for the
lock and then runs on the new weights.

``update_weights`` also needs the engine to be *between requests*: with any request
unfinished it raises :class:`~pagedinfer.errors.RequestsInFlightError` and changes nothing
(a request never mixes two sets of weights: its KV cache and its logprobs all come from one).
RL loops call it between ``generate`` calls, where that holds; a server stops or drains its
traffic first. ``collective_rpc`` runs with requests in flight too (between two of their
steps): what it does to the model is the caller's business.

How an update runs
------------------
1. The tensors are listed (references to the caller's tensors, never copies) and every
   name, dtype and shape is checked on every rank, then the checked values (NaN, infinity:
   ``weight_check``) on the driver: :mod:`pagedinfer.adapters.models.weight_update`. A
   refusal raises :class:`~pagedinfer.errors.WeightUpdateError`; nothing was written.
2. The tensors are written in chunks of at most :data:`CHUNK_BYTES`, each rank copying its
   shard in place. In this process (one rank) the chunks are the caller's tensors; with
   several ranks each chunk is copied to host memory once and sent to the workers (their
   control channel, or Ray's object store), so the extra memory is one chunk.
3. The prefix cache is reset: cached KV was computed with the old weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedinfer.adapters.collective_rpc import RpcMethod
from pagedinfer.adapters.executor import ModelExecutor
from pagedinfer.adapters.models.weight_update import (
    check_update,
    check_update_from_path,
    check_update_values,
    tensor_meta,
    write_update,
    write_update_from_path,
)
from pagedinfer.errors import EngineClosedError, RequestsInFlightError, WeightUpdateError

if TYPE_CHECKING:
    from pagedinfer.domain.scheduler import Scheduler
    from pagedinfer.engine.config import EngineConfig
    from pagedinfer.engine.engine_lock import EngineLock
    from pagedinfer.engine.in_flight import InFlight
    from pagedinfer.engine.request_table import RequestTable

__all__ = ["CHUNK_BYTES", "RpcMethod", "WeightSync", "Weights"]

CHUNK_BYTES = 64 << 20
"""The most tensor bytes one write of an update sends to the ranks at a time."""

Weights = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


class WeightSync:
    """``update_weights``, ``update_weights_from_path`` and ``collective_rpc`` (see the
    module docstring); mixed into :class:`~pagedinfer.engine.engine.Engine`."""

    # The Engine's state these methods use (set by Engine.__init__).
    config: EngineConfig
    scheduler: Scheduler
    _guard: EngineLock
    _executor: ModelExecutor | None
    _table: RequestTable
    _flights: InFlight
    _stepping: bool

    if TYPE_CHECKING:  # Engine's

        def _check_open(self) -> None: ...
        def _step(self) -> bool: ...

    def update_weights(self, weights: Weights) -> None:
        """Write new values for any subset of the model's tensors, named as in the model's
        Hugging Face checkpoint (``model.layers.0.self_attn.q_proj.weight``, ...):
        ``(name, tensor)`` pairs or a mapping (a trainer's ``named_parameters()`` or
        ``state_dict()``), in any float dtype (converted to the engine's), full (unsharded)
        shapes: with tensor parallelism each rank takes its shard.

        Every tensor is checked before any is written: a name that maps to no parameter, a
        wrong shape or dtype, a tensor twice, a NaN in a checked tensor (``weight_check``) or
        a quantized layer's tensor raises :class:`~pagedinfer.errors.WeightUpdateError` and
        leaves the old weights in place. Unfinished requests raise
        :class:`~pagedinfer.errors.RequestsInFlightError` (call it between ``generate``
        calls). The prefix cache is reset. docs/rl.md says what it costs.
        """
        with self._between_requests("update_weights") as executor:
            items = _listed(weights)
            metas = [tensor_meta(name, tensor) for name, tensor in items]
            executor.collective_rpc(check_update, args=(metas,))
            check_update_values(self.config.weight_check, items)
            try:
                for chunk in _chunks(items, remote=self._remote):
                    executor.collective_rpc(write_update, args=(chunk,))
            finally:
                self.scheduler.reset_prefix_cache()

    def update_weights_from_path(self, path: str | Path) -> None:
        """:meth:`update_weights` from the ``*.safetensors`` files of checkpoint directory
        ``path`` (the index's files, else all), any subset of the model's tensors. Checked
        from the files' headers first (and the values ``weight_check`` names); then each rank
        reads the files itself, one tensor at a time."""
        with self._between_requests("update_weights_from_path") as executor:
            executor.collective_rpc(check_update_from_path, args=(str(path),))
            try:
                executor.collective_rpc(write_update_from_path, args=(str(path),))
            finally:
                self.scheduler.reset_prefix_cache()

    def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's ``collective_rpc``: run ``method`` on every rank's worker (a
        :class:`~pagedinfer.adapters.model_runner.ModelRunner`; ``method`` names one of its
        methods, or is a function called as ``method(runner, *args, **kwargs)``) between
        steps, and return the results in rank order. With ``tensor_parallel_size > 1`` a
        function must be picklable (module-level). ``timeout``: seconds to wait for the
        other ranks (None: ``worker_timeout_s``). Does not reset the prefix cache: call
        :meth:`reset_prefix_cache` after changing weights this way."""
        with self._between_steps("collective_rpc", idle=False) as executor:
            return executor.collective_rpc(method, timeout, args=tuple(args), kwargs=kwargs)

    # ------------------------------------------------------------------ helpers
    @property
    def _remote(self) -> bool:
        """Whether some rank runs in another process (tensors must travel to it)."""
        config = self.config
        return config.tensor_parallel_size * config.pipeline_parallel_size > 1

    @contextmanager
    def _between_requests(self, what: str) -> Iterator[ModelExecutor]:
        with self._between_steps(what, idle=True) as executor:
            yield executor

    @contextmanager
    def _between_steps(self, what: str, *, idle: bool) -> Iterator[ModelExecutor]:
        """Hold the lock with no step running (see the module docstring)."""
        with self._guard.held():
            self._check_open()
            while self._stepping:
                self._guard.wait_for_change()
                self._check_open()
            if (idle or self._flights) and self._table:
                count = len(self._table.requests)
                raise RequestsInFlightError(
                    f"{what} found {count} unfinished request(s)"
                    + (" and a step in flight (async scheduling)" if self._flights else "")
                    + f": it runs between requests. Wait for them (or abort them), then call "
                    f"{what} again."
                )
            while self._flights:  # a step launched ahead after the last request finished
                self._step()
            executor = self._executor
            if executor is None:
                raise EngineClosedError("the engine is closed; create a new Engine.")
            yield executor


def _listed(weights: Weights) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of ``weights`` (references, no copies), checked."""
    pairs = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    for index, pair in enumerate(pairs):
        if not (
            isinstance(pair, tuple)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and isinstance(pair[1], torch.Tensor)
        ):
            raise WeightUpdateError(
                f"update_weights: item {index} is {type(pair).__name__} {_short(pair)}: "
                "expected (name, torch.Tensor) pairs or a mapping of names to tensors."
            )
    return pairs


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _chunks(
    items: list[tuple[str, torch.Tensor]], *, remote: bool
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``items`` in chunks of at most :data:`CHUNK_BYTES` (a larger tensor alone); for
    ranks in other processes, copied to host memory one chunk at a time."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
        moved = tensor.detach().to("cpu", copy=True).contiguous() if remote else tensor.detach()
        chunk.append((name, moved))
        size += nbytes
    if chunk:
        yield chunk
