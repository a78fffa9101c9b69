"""The GPU preflight: compile every kernel configuration the engine launches, for each GPU
target, with Triton's compiler on the CPU (no device), and fail on what would fail on a GPU.

1. :func:`~.sweep.sweep` records, per target, the launches the wrappers choose over the
   model shapes.
2. Launches that compile to the same code but for sizes are grouped: a constexpr in
   :data:`SIZE_CONSTEXPRS` only sizes the problem (index arithmetic and masks; tiles, dtypes,
   flags, warps and stages are all kept), so one launch of each group is compiled. A kernel
   that grows a new size constexpr not listed is merely compiled more often.
3. Each group is compiled for each target through TTGIR and its shared-memory allocation
   (:func:`~.compile.compile_launch`), one launch per group (specialization attributes,
   divisibility by 16 and alignment, are not part of a group's key). sm_89 reuses sm_80's
   compile of a group both record when it holds no float8 type (Triton's pipeline is the
   same for 8.x but for FP8 conversions), checked against sm_89's smaller shared memory.
   Groups of the :data:`RESOURCE_CASES` go the whole way on sm_90, through ``ptxas``, for
   registers and spills.
4. Fails on any compile error and on shared memory above a target's limit.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from pagedinfer.adapters.kernels.launch import RecordedLaunch
from pagedinfer.adapters.kernels.preflight.compile import CompileResult, compile_launch
from pagedinfer.adapters.kernels.preflight.sweep import SweptLaunch, sweep
from pagedinfer.adapters.kernels.target import KNOWN_TARGETS, KernelTarget

__all__ = ["SIZE_CONSTEXPRS", "PreflightReport", "coverage_key", "run_preflight"]

SIZE_CONSTEXPRS = frozenset(
    {
        "BLOCK_SIZE",  # tokens per cache page: the page lookup's divisor
        "HALF",
        "HEAD_DIM",  # the mask against its padded power of two (which is kept)
        "HIDDEN",
        "NUM_CHUNKS",
        "NUM_HEADS",
        "NUM_KV_HEADS",
        "NUM_Q_BLOCKS",
        "QUERIES_PER_KV",
        "TOP_K",
        "WIDTH",
    }
)
RESOURCE_TARGET = 90
# Sweep cases whose groups get registers and spills (on RESOURCE_TARGET): a dense model, the
# MoE model and the head-dim-256 one, in bfloat16 (every kernel, each KV cache format).
RESOURCE_CASES = ("Qwen3-8B bfloat16", "Qwen3-30B-A3B bfloat16", "Gemma-7B (head dim 256) bfloat16")


def coverage_key(launch: RecordedLaunch) -> tuple[object, ...]:
    """What decides a launch's compiled code but for problem sizes (see the module doc)."""
    names = [name for name, _ in launch.signature]
    kept = tuple((p, v) for p, v in launch.constexprs if names[p[0]] not in SIZE_CONSTEXPRS)
    signature = tuple(
        (name, kind)
        for name, kind in launch.signature
        if not (kind == "constexpr" and name in SIZE_CONSTEXPRS)
    )
    return (launch.module, launch.name, signature, kept, launch.num_warps, launch.num_stages)


@dataclass(frozen=True, slots=True)
class _Job:
    launch: RecordedLaunch
    target: KernelTarget
    resources: bool
    cases: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CheckedLaunch:
    """A compile result, the targets it stands for and the sweep cases that launch it."""

    result: CompileResult
    targets: tuple[KernelTarget, ...]
    cases: tuple[str, ...]

    def over_limit(self) -> list[KernelTarget]:
        shared = self.result.shared
        return [t for t in self.targets if shared is not None and shared > t.shared_memory]


@dataclass(frozen=True, slots=True)
class PreflightReport:
    checked: list[CheckedLaunch]
    launches: int  # recorded, with repeats, all targets
    seconds: float

    @property
    def failures(self) -> list[CheckedLaunch]:
        return [c for c in self.checked if c.result.error is not None or c.over_limit()]


def _sweep(target: KernelTarget) -> list[SweptLaunch]:
    return sweep(target)


def _compile(job: _Job) -> CompileResult:
    return compile_launch(job.launch, job.target, resources=job.resources)


def _plan(
    swept: dict[int, list[SweptLaunch]], targets: list[KernelTarget]
) -> tuple[list[_Job], dict[int, list[KernelTarget]]]:
    """The compiles to run and, by job index, the targets each stands for."""
    jobs: list[_Job] = []
    stands_for: dict[int, list[KernelTarget]] = {}
    shared_8x: dict[tuple[object, ...], int] = {}  # sm_80's job of a group
    for target in targets:
        groups: dict[tuple[object, ...], list[SweptLaunch]] = {}
        for item in swept[target.capability]:
            groups.setdefault(coverage_key(item.launch), []).append(item)
        for key, items in groups.items():
            cases = tuple(dict.fromkeys(item.case for item in items))
            fp8 = any("fp8" in kind for _, kind in items[0].launch.signature)
            if target.capability == 89 and key in shared_8x and not fp8:
                stands_for[shared_8x[key]].append(target)
                continue
            resources = target.capability == RESOURCE_TARGET and any(
                case in RESOURCE_CASES for case in cases
            )
            stands_for[len(jobs)] = [target]
            if target.capability == 80:
                shared_8x[key] = len(jobs)
            jobs.append(_Job(items[0].launch, target, resources, cases))
    return jobs, stands_for


def _cost(job: _Job) -> float:
    """A rough compile time, to start the long ones first."""
    heavy = {"_prefill_kernel": 4.0, "_decode_kernel": 2.5}.get(job.launch.name, 1.0)
    return heavy * (3.0 if job.resources else 1.0)


def run_preflight(targets: Iterable[int], jobs: int = 2) -> PreflightReport:
    """Sweep, group and compile for ``targets`` (capabilities) with ``jobs`` processes."""
    start = time.perf_counter()
    chosen = [KNOWN_TARGETS[capability] for capability in targets]
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=context) as pool:
        swept = dict(zip((t.capability for t in chosen), pool.map(_sweep, chosen), strict=True))
        planned, stands_for = _plan(swept, chosen)
        order = sorted(range(len(planned)), key=lambda i: -_cost(planned[i]))
        results = dict(zip(order, pool.map(_compile, [planned[i] for i in order]), strict=True))
    checked = [
        CheckedLaunch(results[i], tuple(stands_for[i]), planned[i].cases)
        for i in range(len(planned))
    ]
    return PreflightReport(
        checked=checked,
        launches=sum(len(items) for items in swept.values()),
        seconds=time.perf_counter() - start,
    )
