"""A spy that fails a test when a step's launch would make the host wait for the device.

On CUDA a blocking host-to-device copy (``tensor.to(device)``, ``torch.tensor(values,
device=...)``), a device-to-host read (``.tolist()``, ``.item()``, ``bool(tensor)``,
``.cpu()``) or a cross-device ``copy_`` without ``non_blocking=True`` waits for the stream:
in a step planned ahead (async scheduling) that is the previous step's whole forward. On the
CPU nothing waits, so the spy watches the *calls* that would: while a thread is inside
:meth:`SyncSpy.watching` (the tests wrap ``ModelRunner.launch``), every such call from that
thread is recorded with the code line that made it. Other threads (the engine's reader of
outputs) are not watched. The GPU tests check the same path with
``torch.cuda.set_sync_debug_mode("error")``; this spy is the guard ``make test`` runs.

Calls from :data:`EXEMPT_FILES` are not counted: the CPU-only reference attention backend
reads its own host metadata (it never runs in a CUDA step).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["EXEMPT_FILES", "SyncSpy"]

EXEMPT_FILES = ("pagedinfer/adapters/attention/torch_ref.py",)

_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__")


def _is_device(value: object) -> bool:
    if isinstance(value, torch.device):
        return True
    if isinstance(value, str):
        try:
            torch.device(value)
        except RuntimeError:
            return False
        return True
    return False


def _caller() -> str:
    """``file:line`` of the first frame outside this module and torch."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__ and "/torch/" not in name:
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


class SyncSpy:
    """Patches torch's waiting entry points while installed; records the watched calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.launches = 0  # calls of wrapped launches (a test checks it watched something)
        self._local = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    # ------------------------------------------------------------------ use
    @contextmanager
    def installed(self) -> Iterator[SyncSpy]:
        self._patch()
        try:
            yield self
        finally:
            for owner, name, original in reversed(self._saved):
                setattr(owner, name, original)
            self._saved.clear()

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Record the current thread's waiting calls inside this block."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def wrap(self, launch: Callable[..., Any]) -> Callable[..., Any]:
        """``launch`` with its own work watched (not the reading of its output)."""

        def watched(*args: Any, **kwargs: Any) -> Any:
            self.launches += 1
            with self.watching():
                return launch(*args, **kwargs)

        return watched

    # ------------------------------------------------------------ internals
    def _active(self) -> bool:
        return getattr(self._local, "depth", 0) > 0 and not getattr(self._local, "inside", False)

    def _record(self, what: str) -> None:
        where = _caller()
        if not any(where.split(":")[0].endswith(exempt) for exempt in EXEMPT_FILES):
            self.calls.append(f"{what} at {where}")

    def _guarded(self, what: str, original: Any, check: Callable[..., bool]) -> Any:
        spy = self

        def patched(*args: Any, **kwargs: Any) -> Any:
            if spy._active():
                if check(*args, **kwargs):
                    spy._record(what)
                spy._local.inside = True  # torch's own nested calls are not the caller's
                try:
                    return original(*args, **kwargs)
                finally:
                    spy._local.inside = False
            return original(*args, **kwargs)

        return patched

    def _replace(self, owner: Any, name: str, what: str, check: Callable[..., bool]) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, self._guarded(what, original, check))

    def _patch(self) -> None:
        for name in _READS:
            self._replace(torch.Tensor, name, f"Tensor.{name}()", lambda *a, **k: True)

        def blocking_to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
            target = kwargs.get("device")
            target = (
                target
                if target is not None
                else next((arg for arg in args if _is_device(arg)), None)
            )
            return target is not None and not kwargs.get("non_blocking", False)

        self._replace(torch.Tensor, "to", "a blocking Tensor.to(device)", blocking_to)

        def blocking_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> bool:
            return dst.device != src.device and not non_blocking

        self._replace(torch.Tensor, "copy_", "a blocking cross-device copy_", blocking_copy)

        def placed(*args: Any, **kwargs: Any) -> bool:
            return kwargs.get("device") is not None

        for name in ("tensor", "as_tensor"):
            self._replace(torch, name, f"torch.{name}(..., device=)", placed)
