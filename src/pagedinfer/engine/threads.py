"""``num_threads``: how many torch CPU threads an engine sets (``"auto"``, the default: half
the CPUs this process may use; docs/api.md, docs/benchmarks.md "CPU threads under
contention")."""

from __future__ import annotations

import math
import os

__all__ = ["available_cpus", "default_num_threads", "resolve_num_threads"]


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, bounded by a cgroup CPU quota
    (a container's ``--cpus``) where there is one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cpus, quota) if quota is not None else cpus)


def _cgroup_cpu_quota() -> int | None:
    """CPUs allowed by the cgroup v2 quota (``cpu.max``, rounded up), or None if unlimited."""
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as file:
            quota, period = file.read().split()[:2]
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def default_num_threads(tensor_parallel_size: int = 1) -> int:
    """``num_threads="auto"``: half the CPUs this process may use (:func:`available_cpus`),
    shared by the tensor-parallel ranks, at least 1.

    Half, not all: torch's CPU kernels split every operation across their threads and wait
    for the slowest, so when another busy process holds a core a step waits for a thread that
    is not running. Measured on 2 cores beside other work (docs/benchmarks.md): 2 threads
    decoded at 37 tok/s, 1 thread at 622 tok/s. On a machine of one's own, half the cores
    costs less than that collapse (torch's default: one thread per core).
    """
    return max(1, available_cpus() // 2 // max(1, tensor_parallel_size))


def resolve_num_threads(requested: int | str | None, tensor_parallel_size: int) -> int | None:
    """The thread count to set (``None``: leave torch's alone)."""
    if requested == "auto":
        return default_num_threads(tensor_parallel_size)
    assert requested is None or isinstance(requested, int)
    return requested
