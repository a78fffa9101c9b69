"""What a launch wrapper may ask about the GPU it launches on: compute capability, SM count
and shared memory per block.

On CUDA this is the device's (torch's cached properties: no host sync). Under
:func:`targeting` it is a given target instead, with no device at all: the GPU preflight
(:mod:`pagedinfer.adapters.kernels.preflight`) drives the wrappers with meta tensors for
sm_80, sm_89 and sm_90, and each wrapper must then choose exactly what it would choose on
such a GPU. Elsewhere (the CPU interpreter) there is no target and wrappers keep their
defaults.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

__all__ = ["KNOWN_TARGETS", "KernelTarget", "kernel_target", "targeting"]


@dataclass(frozen=True, slots=True)
class KernelTarget:
    """A GPU as the launch wrappers see it."""

    capability: int  # major * 10 + minor: 80, 89, 90, 100
    num_sms: int
    shared_memory: int  # bytes one block may use (the opt-in maximum)

    @property
    def name(self) -> str:
        return f"sm_{self.capability}"


KNOWN_TARGETS: dict[int, KernelTarget] = {
    80: KernelTarget(80, num_sms=108, shared_memory=163 * 1024),  # A100
    89: KernelTarget(89, num_sms=142, shared_memory=99 * 1024),  # L40S (RTX 4090: 128 SMs)
    90: KernelTarget(90, num_sms=132, shared_memory=227 * 1024),  # H100 SXM
    100: KernelTarget(100, num_sms=148, shared_memory=227 * 1024),  # B200
}
"""The preflight's targets: each architecture's shared-memory limit and a typical SM count."""

_TARGET: ContextVar[KernelTarget | None] = ContextVar("pagedinfer_kernel_target", default=None)


@contextmanager
def targeting(target: KernelTarget) -> Iterator[KernelTarget]:
    """Within the block, :func:`kernel_target` answers ``target`` whatever the device."""
    token = _TARGET.set(target)
    try:
        yield target
    finally:
        _TARGET.reset(token)


def kernel_target(device: torch.device) -> KernelTarget | None:
    """The target a launch on ``device`` compiles for; ``None`` off CUDA (the interpreter)."""
    override = _TARGET.get()
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_target(index)


@functools.cache
def _cuda_target(index: int) -> KernelTarget:
    props = torch.cuda.get_device_properties(index)
    capability = props.major * 10 + props.minor
    known = KNOWN_TARGETS.get(capability, KNOWN_TARGETS[80])
    return KernelTarget(
        capability=capability,
        num_sms=int(props.multi_processor_count),
        shared_memory=int(getattr(props, "shared_memory_per_block_optin", known.shared_memory)),
    )
