"""Every Triton launch of this package goes through :func:`launch`, so that it can be recorded.

``launch(kernel, grid)(*args, **kwargs)`` is ``kernel[grid](*args, **kwargs)``. Inside
:func:`recording_launches` nothing runs: each launch is recorded instead, as the compiler
sees it — the kernel, its signature (argument types), its constexprs, its specialization
attributes (divisibility by 16, pointer alignment) and its ``num_warps`` / ``num_stages`` —
exactly as Triton's own launcher derives them from the arguments. The GPU preflight
(:mod:`pagedinfer.adapters.kernels.preflight`) drives the wrappers that way, with meta
tensors, over a sweep of model shapes, and compiles what they chose for each GPU target:
the configurations come from the wrappers themselves, never from a hand-written list.

A recording also sets :func:`~pagedinfer.adapters.kernels.target.kernel_target` to its
target, so a wrapper that adapts to the GPU (SM count, shared memory) chooses as it would on
that GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from pagedinfer.adapters.kernels.target import KernelTarget, targeting

__all__ = ["RecordedLaunch", "launch", "recording_launches"]

# Triton's CUDA defaults when a launch does not say.
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3


@dataclass(frozen=True, slots=True)
class RecordedLaunch:
    """One compiled variant a wrapper asked for (hashable: equal launches compile the same).

    ``module`` / ``name`` locate the kernel (``getattr(import_module(module), name)``);
    ``signature`` maps every argument to its Triton type (``"*bf16"``, ``"i32"``,
    ``"constexpr"``); ``constexprs`` and ``attrs`` are keyed by argument path as
    :class:`triton.compiler.ASTSource` takes them.
    """

    module: str
    name: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[tuple[int, ...], Any], ...]
    attrs: tuple[tuple[tuple[int, ...], tuple[tuple[str, Any], ...]], ...]
    num_warps: int
    num_stages: int

    @property
    def kernel(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.name}"

    def constexpr_values(self) -> dict[str, Any]:
        """The constexprs by argument name (for reports)."""
        names = [name for name, _ in self.signature]
        return {names[path[0]]: value for path, value in self.constexprs if len(path) == 1}


@dataclass
class _Recorder:
    target: KernelTarget
    launches: list[RecordedLaunch] = field(default_factory=list)
    _binders: dict[int, tuple[Any, Any, Any]] = field(default_factory=dict)

    def record(self, kernel: Any, grid: object, *args: Any, **kwargs: Any) -> None:
        del grid  # shapes only; it does not change the compiled code
        jit, backend, binder = self._binder(kernel)
        # Triton's launcher's own two steps (JITFunction.run, Triton 3.6): bind and specialize
        # the arguments, then split them into signature, constexprs and attributes. Private
        # API; tests/unit/kernels/test_launch_recording.py fails if it changes.
        bound, specialization, options = binder(*args, **kwargs)
        _, signature, constexprs, attrs = jit._pack_args(
            backend, kwargs, bound, specialization, options
        )
        self.launches.append(
            RecordedLaunch(
                module=jit.fn.__module__,
                name=jit.fn.__name__,
                signature=tuple(signature.items()),
                constexprs=tuple(sorted(constexprs.items())),
                attrs=tuple(
                    sorted((path, tuple(tuple(a) for a in attr)) for path, attr in attrs.items())
                ),
                num_warps=int(kwargs.get("num_warps", DEFAULT_NUM_WARPS)),
                num_stages=int(kwargs.get("num_stages", DEFAULT_NUM_STAGES)),
            )
        )

    def _binder(self, kernel: Any) -> tuple[Any, Any, Any]:
        """Triton's own argument binder for ``kernel`` (a JIT or an interpreted function)."""
        cached = self._binders.get(id(kernel))
        if cached is not None:
            return cached
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        jit = kernel
        if not isinstance(kernel, JITFunction):  # the interpreter's: same function, same flags
            jit = JITFunction(kernel.fn, **kernel.kwargs)
        backend = make_backend(GPUTarget("cuda", self.target.capability, 32))
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        self._binders[id(kernel)] = (jit, backend, binder)
        return jit, backend, binder


_RECORDER: ContextVar[_Recorder | None] = ContextVar("pagedinfer_launch_recorder", default=None)


def launch(kernel: Any, grid: tuple[int, ...]) -> Callable[..., object]:
    """``kernel[grid]``, or its recorder inside :func:`recording_launches`."""
    recorder = _RECORDER.get()
    if recorder is None:
        return kernel[grid]  # type: ignore[no-any-return]
    return lambda *args, **kwargs: recorder.record(kernel, grid, *args, **kwargs)


@contextmanager
def recording_launches(target: KernelTarget) -> Iterator[list[RecordedLaunch]]:
    """Record instead of launching, as if on ``target``; yields the list the launches go to."""
    recorder = _Recorder(target)
    token = _RECORDER.set(recorder)
    try:
        with targeting(target):
            yield recorder.launches
    finally:
        _RECORDER.reset(token)
