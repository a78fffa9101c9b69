"""Compile one recorded launch for one GPU target with Triton's compiler, no device needed.

Triton's pipeline is the front end (the kernel's Python AST to Triton IR), then TTGIR, LLVM
IR, PTX and, with ``ptxas``, the cubin. Two depths:

* ``resources=False``: the front end, TTIR, TTGIR (layouts, software pipelining) and the
  shared-memory allocation pass that opens the LLVM-IR stage, which fixes the shared memory
  a block needs; the rest of the lowering (most of the time) is skipped;
* ``resources=True``: the whole pipeline, then ``ptxas -v`` (Triton's own) for registers and
  spills (what ``cuobjdump -res-usage`` prints of the cubin).
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from pagedinfer.adapters.kernels.launch import RecordedLaunch
from pagedinfer.adapters.kernels.target import KernelTarget

__all__ = ["CompileResult", "compile_launch"]

_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True, slots=True)
class CompileResult:
    """What compiling ``launch`` for ``target`` gave: an error, or its resources."""

    launch: RecordedLaunch
    target: KernelTarget
    error: str | None = None
    shared: int | None = None  # bytes of shared memory per block
    registers: int | None = None  # per thread (None: ptxas not run)
    spill_stores: int | None = None  # bytes
    spill_loads: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # by stage

    @property
    def over_shared_limit(self) -> bool:
        return self.shared is not None and self.shared > self.target.shared_memory

    @property
    def failed(self) -> bool:
        return self.error is not None or self.over_shared_limit


def _kernel(launch: RecordedLaunch) -> Any:
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(launch.module), launch.name)
    if not isinstance(kernel, JITFunction):
        raise RuntimeError(
            f"{launch.kernel} is not a compiled Triton kernel (TRITON_INTERPRET is set?): the "
            "preflight compiles; run it without TRITON_INTERPRET"
        )
    return kernel


def compile_launch(
    launch: RecordedLaunch, target: KernelTarget, *, resources: bool
) -> CompileResult:
    """Compile ``launch`` for ``target`` up to LLVM IR (shared memory), and with ``resources``
    through PTX and ``ptxas -v`` (registers, spills). Errors are returned, not raised."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    seconds: dict[str, float] = {}
    gpu = GPUTarget("cuda", target.capability, 32)
    backend = make_backend(gpu)
    options = backend.parse_options(
        {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    )
    source = ASTSource(
        _kernel(launch),
        dict(launch.signature),
        {path: value for path, value in launch.constexprs},
        {path: [list(a) for a in attr] for path, attr in launch.attrs},
    )
    stages: dict[str, Any] = {}
    backend.add_stages(stages, options, source.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    metadata: dict[str, Any] = {}
    stage = "front end"
    try:
        start = time.perf_counter()
        module = source.make_ir(
            gpu, options, backend.get_codegen_implementation(options),
            backend.get_module_map(), context,
        )  # fmt: skip
        seconds[stage] = time.perf_counter() - start
        for stage in ("ttir", "ttgir"):
            start = time.perf_counter()
            module = stages[stage](module, metadata)
            seconds[stage] = time.perf_counter() - start
        if not resources:
            stage = "shared memory"
            start = time.perf_counter()
            shared = _allocate_shared_memory(module, options, target)
            seconds[stage] = time.perf_counter() - start
            return CompileResult(launch, target, shared=shared, seconds=seconds)
        for stage in ("llir", "ptx"):
            start = time.perf_counter()
            module = stages[stage](module, metadata)
            seconds[stage] = time.perf_counter() - start
        shared = int(metadata.get("shared") or 0)
        stage = "ptxas"
        start = time.perf_counter()
        registers, stores, loads = _ptxas_usage(str(module), target)
        seconds[stage] = time.perf_counter() - start
    except Exception as error:
        message = f"{stage}: {type(error).__name__}: {error}"
        return CompileResult(launch, target, error=message, seconds=seconds)
    return CompileResult(
        launch, target, shared=shared, registers=registers, spill_stores=stores,
        spill_loads=loads, seconds=seconds,
    )  # fmt: skip


def _allocate_shared_memory(module: Any, options: Any, target: KernelTarget) -> int:
    """The bytes of shared memory a block of the TTGIR ``module`` needs: the first passes of
    Triton's LLVM-IR stage, up to its shared-memory allocation (what the full stage records
    as ``metadata["shared"]``)."""
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options

    manager = ir.pass_manager(module.context)
    passes.ttgpuir.add_combine_tensor_select_and_if(manager)
    passes.ttgpuir.add_allocate_warp_groups(manager)
    passes.convert.add_scf_to_cf(manager)
    passes.gluon.add_inliner(manager)
    ptx_version = get_ptx_version_from_options(options, target.capability)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(manager, target.capability, ptx_version)
    manager.run(module, "preflight_shared_memory")
    return int(module.get_int_attr("ttg.shared") or 0)


def _ptxas_usage(ptx: str, target: KernelTarget) -> tuple[int, int, int]:
    """``(registers, spill store bytes, spill load bytes)`` from ``ptxas -v`` (Triton's)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(target.capability).path
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as file:
            file.write(ptx)
        result = subprocess.run(
            [ptxas, "-v", f"--gpu-name={sm_arch_from_capability(target.capability)}", source,
             "-o", os.path.join(folder, "kernel.cubin")],
            capture_output=True, text=True, check=False, timeout=300,
        )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"ptxas failed ({result.returncode}): {result.stderr.strip()}")
    usage = _PTXAS_USAGE.search(result.stderr)
    spills = _PTXAS_SPILLS.search(result.stderr)
    if usage is None or spills is None:
        raise RuntimeError(f"ptxas -v printed no resource usage: {result.stderr.strip()}")
    return int(usage.group(1)), int(spills.group(1)), int(spills.group(2))
