"""Count the kernel launches of a forward pass on the CPU: torch ops that launch a kernel plus
Triton kernel launches (run by the interpreter), attributed to decoder layers.

A torch op launches a kernel unless it only allocates (``empty*``) or every tensor it returns
shares storage with one of its inputs (views, reshapes that did not copy, ``to`` to the same
dtype). A dtype cast is a copy, so it counts, as it would on a GPU. Ops that run *inside* a
Triton launch (the interpreter copies its arguments to and from host memory) are not counted:
they are the launch.

Importable as ``launch_counter`` (the root ``conftest.py`` puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LaunchCount", "count_launches"]

# Allocation and bookkeeping ops: no kernel runs (or only a host-side scalar read).
_NO_KERNEL = frozenset(
    {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "set_"}
)


@dataclass
class LaunchCount:
    """Launches per decoder layer (in layer order) and outside the layers, with op names."""

    per_layer: list[collections.Counter[str]] = field(default_factory=list)
    outside: collections.Counter[str] = field(default_factory=collections.Counter)

    def layer_totals(self) -> list[int]:
        return [sum(layer.values()) for layer in self.per_layer]

    @property
    def outside_total(self) -> int:
        return sum(self.outside.values())

    def describe(self) -> str:
        lines = [f"outside layers: {self.outside_total} {dict(self.outside)}"]
        for index, layer in enumerate(self.per_layer):
            lines.append(f"layer {index}: {sum(layer.values())} {dict(layer)}")
        return "\n".join(lines)


def _storages(value: Any) -> set[int]:
    return {
        leaf.untyped_storage().data_ptr()
        for leaf in tree_leaves(value)
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta"
    }


class _Recorder(TorchDispatchMode):
    def __init__(self, count: LaunchCount) -> None:
        super().__init__()
        self.count = count
        self.current: collections.Counter[str] = count.outside
        self.suspended = 0

    def record(self, name: str) -> None:
        if not self.suspended:
            self.current[name] += 1

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.suspended:
            return out
        name = func.overloadpacket.__name__
        if name in _NO_KERNEL:
            return out
        outputs = _storages(out)
        mutates = func._schema.is_mutable  # in place, or an out= argument
        if not outputs and not mutates and name != "_local_scalar_dense":
            return out  # metadata only (result_type, sizes): no kernel; .item() is a copy
        if outputs and outputs <= _storages((args, kwargs)) and not mutates:
            return out  # a view or alias: no kernel
        self.record(name)
        return out


@contextmanager
def count_launches(layers: nn.ModuleList) -> Iterator[LaunchCount]:
    """Count launches inside the ``with`` block; ops between a layer's pre- and post-forward
    hooks belong to that layer."""
    count = LaunchCount(per_layer=[collections.Counter() for _ in layers])
    recorder = _Recorder(count)
    handles = []
    for index, layer in enumerate(layers):

        def enter(_module: nn.Module, _args: Any, index: int = index) -> None:
            recorder.current = count.per_layer[index]

        def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
            recorder.current = count.outside

        handles.append(layer.register_forward_pre_hook(enter))
        handles.append(layer.register_forward_hook(leave))

    from triton.runtime.interpreter import InterpretedFunction

    original_run = InterpretedFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("warmup"):
            return original_run(self, *args, **kwargs)
        recorder.record(f"triton:{self.fn.__name__}")
        recorder.suspended += 1
        try:
            return original_run(self, *args, **kwargs)
        finally:
            recorder.suspended -= 1

    InterpretedFunction.run = run
    try:
        with recorder:
            yield count
    finally:
        InterpretedFunction.run = original_run
        for handle in handles:
            handle.remove()
