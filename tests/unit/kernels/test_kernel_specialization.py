"""Kernel arguments that change class from step to step are not specialization keys.

Triton compiles a variant per specialization key: integers are keyed on being 1 and on
divisibility by 16, pointers on 16-byte alignment, unless a kernel opts out. A step-dependent
argument that is keyed compiles a new variant mid-run, ~1 s each. Seen on an H100: the GPU
report's first run compiled two prefill variants in its mixed steps, whose prefill rows' int32
metadata (block tables, query offsets, context lengths) are slices of the step's packed inputs
that start after the decode rows, at 4-byte offsets.

``tests/gpu/test_no_recompile_gpu.py`` shows it end to end on a GPU. This checks the kernels'
declarations on any machine: in a child process without ``TRITON_INTERPRET`` (so ``triton.jit``
builds real ``JITFunction`` objects; nothing is compiled or launched), every argument listed
here must be exempt from specialization.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# Arguments whose value class can change from step to step, by kernel.
STEP_DEPENDENT = {
    "prefill_attention._prefill_kernel": {
        "block_tables_ptr",
        "cu_seqlens_q_ptr",
        "context_lens_ptr",
        "kv_scales_ptr",
        "stride_table_seq",
    },
    "decode_attention._decode_kernel": {
        "block_tables_ptr",
        "context_lens_ptr",
        "kv_scales_ptr",
        "num_splits",
        "stride_table_seq",
    },
    # A layer's FP8 scale row, or an unused stand-in (a metadata slice) without FP8.
    "store_kv._store_kv_kernel": {"kv_scales_ptr"},
    "qk_norm_rope._qk_norm_rope_kernel": {"kv_scales_ptr"},
    "decode_attention._reduce_splits_kernel": {"num_splits"},
    "moe._grouped_gemm_kernel": {"num_pairs"},  # the step's tokens x k
    "race_sample._race_chunks_kernel": {
        "temperatures_ptr",
        "seeds_ptr",
        "steps_ptr",
        "stride_temperature",
        "stride_seed",
        "stride_step",
        "key_lo",
        "key_hi",
    },
}

_CHILD = """
import importlib, json, sys
exempt = {}
for name in sys.argv[1:]:
    module, kernel = name.split(".")
    function = getattr(importlib.import_module("pagedinfer.adapters.kernels." + module), kernel)
    exempt[name] = sorted(
        p.name for p in function.params
        if p.do_not_specialize or getattr(p, "do_not_specialize_on_alignment", False)
    )
print(json.dumps(exempt))
"""


def test_step_dependent_arguments_are_not_specialization_keys() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, *STEP_DEPENDENT],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    exempt = json.loads(result.stdout.strip().splitlines()[-1])
    for kernel, arguments in STEP_DEPENDENT.items():
        missing = arguments - set(exempt[kernel])
        assert not missing, f"{kernel} specializes on {sorted(missing)}"
