"""Host-device transfers that never make the host wait for the device stream.

A blocking copy (``tensor.to(cuda)``, ``torch.tensor(values, device=cuda)``, ``.tolist()`` of
a device tensor) waits for everything queued on the stream: in a step planned ahead of the
previous one's tokens (async scheduling) that is the previous step's whole forward, which
undoes the overlap. The two classes here are the launch path's way to move small index
tensors and results:

* :class:`HostUploads`: host values -> a device tensor. The values are written into a pinned
  host *arena* allocated once (two of them, used in turn) and copied with
  ``non_blocking=True``. Each arena is guarded by a CUDA event recorded after the last copy
  that reads it; the host waits for that event only before it writes into the arena again,
  a switch that comes after many steps (arenas hold thousands of small uploads), by which
  time the copy has long finished.
* :class:`Readbacks`: a device tensor -> host memory. The copy into a pinned buffer is queued
  behind the work that produces the tensor, with an event; :meth:`Readback.read` waits for
  that event only (not for work launched later) and hands the buffer back to a pool, so no
  step allocates pinned memory.

On the CPU both degrade to plain tensors: uploads are fresh CPU tensors and readbacks read
the tensor itself.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TypeAlias

import torch

__all__ = ["HostUploads", "Readback", "Readbacks"]

_ALIGNMENT = 64  # bytes: every upload starts on a multiple (Triton specializes on alignment)
_DEFAULT_ARENA_BYTES = 1 << 20


_Values: TypeAlias = "array[int] | array[float] | Sequence[int] | Sequence[float]"


def _host_tensor(values: _Values, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``values`` (a view of an ``array`` whose item size matches ``dtype``)."""
    if isinstance(values, array) and values.itemsize == dtype.itemsize and len(values):
        return torch.frombuffer(values, dtype=dtype)
    return torch.tensor(list(values), dtype=dtype)


class HostUploads:
    """Small host values -> device tensors, through pinned arenas allocated once (CUDA)."""

    def __init__(self, device: torch.device, arena_bytes: int = _DEFAULT_ARENA_BYTES) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._arenas: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None, None]
        if self._pinned:
            self._arenas = [self._allocate(arena_bytes), self._allocate(arena_bytes)]
        self._current = 0
        self._offset = 0

    @staticmethod
    def _allocate(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def upload(
        self,
        values: array[int] | array[float] | Sequence[int] | Sequence[float],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """``values`` as a ``dtype`` tensor on the device, copied without blocking the host.

        The returned tensor owns its memory (the caller may change ``values`` afterwards).
        """
        host = _host_tensor(values, dtype)
        if self.device.type == "cpu":
            return host.clone() if isinstance(values, array) and len(values) else host
        if not self._pinned:  # another device type (meta in tests): nothing to overlap
            return host.to(self.device)
        numel = int(host.numel())
        result = torch.empty(numel, dtype=dtype, device=self.device)
        if numel == 0:
            return result
        nbytes = -(-numel * dtype.itemsize // _ALIGNMENT) * _ALIGNMENT
        staging = self._reserve(nbytes)[: numel * dtype.itemsize].view(dtype)
        staging.copy_(host)  # host memory to host memory
        result.copy_(staging, non_blocking=True)
        event = self._events[self._current] or torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()  # after every copy from this arena: the last one covers the others
        self._events[self._current] = event
        return result

    def _reserve(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the current arena that no queued copy reads (switches when full)."""
        arena = self._arenas[self._current]
        if self._offset + nbytes > arena.numel():
            self._current ^= 1
            self._offset = 0
            event = self._events[self._current]
            if event is not None:
                event.synchronize()  # its copies were queued many steps ago: long done
            arena = self._arenas[self._current]
            if arena.numel() < nbytes:
                arena = self._allocate(max(nbytes, 2 * arena.numel()))
                self._arenas[self._current] = arena
        start = self._offset
        self._offset += nbytes
        return arena[start : start + nbytes]


class Readback:
    """A device tensor's copy on its way to the host; :meth:`read` waits for it only."""

    __slots__ = ("_buffer", "_event", "_host", "_pool")

    def __init__(
        self,
        host: torch.Tensor,
        event: torch.cuda.Event | None,
        pool: list[torch.Tensor] | None,
        buffer: torch.Tensor | None,
    ) -> None:
        self._host = host
        self._event = event
        self._pool = pool
        self._buffer = buffer

    def wait(self) -> torch.Tensor:
        """The tensor on the host (valid until :meth:`read` or :meth:`release`)."""
        if self._event is not None:
            self._event.synchronize()  # this copy only, not what was launched after it
        return self._host

    def read(self) -> list[int]:
        """The values as a Python list; the pinned buffer goes back to its pool."""
        values: list[int] = self.wait().tolist()
        self.release()
        return values

    def release(self) -> None:
        """Give the pinned buffer back (after the values were read)."""
        if self._pool is not None and self._buffer is not None:
            self._pool.append(self._buffer)
        self._pool = self._buffer = None


class Readbacks:
    """Device tensors -> pinned host buffers reused from a pool (CUDA); the CPU reads in place."""

    _MAX_POOLED = 8

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pools: dict[torch.dtype, list[torch.Tensor]] = {}

    def start(self, tensor: torch.Tensor) -> Readback:
        """Queue the copy of a 1-D ``tensor`` to the host behind the work that makes it."""
        if tensor.device.type != "cuda":
            return Readback(tensor, None, None, None)
        pool = self._pools.setdefault(tensor.dtype, [])
        numel = int(tensor.numel())
        buffer = None
        while buffer is None:
            try:  # read() on another thread may hand buffers back meanwhile
                candidate = pool.pop()
            except IndexError:
                break
            if candidate.numel() >= numel:
                buffer = candidate
        if buffer is None:
            buffer = torch.empty(max(numel, 256), dtype=tensor.dtype, pin_memory=True)
        host = buffer[:numel].view(tensor.shape)
        host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return Readback(host, event, pool if len(pool) < self._MAX_POOLED else None, buffer)
