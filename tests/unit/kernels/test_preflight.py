"""The GPU preflight's checks, on the CPU: a compile error fails, shared memory over a
target's limit fails, and the FP8 fused store (once rejected by Triton's compiler, which the
interpreter never runs) compiles.

Compiling needs real ``triton.jit`` functions, so the checks run in a child process without
``TRITON_INTERPRET`` (as ``test_kernel_specialization`` does); nothing needs a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# A kernel whose variable changes type inside a run-time branch (float32 -> uint8): the bug
# the preflight found in qk_norm_rope; ``FIXED`` gives the bytes a new name.
_KERNELS = """
import triton
import triton.language as tl


@triton.jit
def broken_kernel(x_ptr, out_ptr, flag, BLOCK: tl.constexpr, FIXED: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    y = tl.load(x_ptr + offs).to(tl.float32)
    if flag > 0:
        if FIXED:
            tl.store(out_ptr + offs, y.to(tl.uint8))
        else:
            y = y.to(tl.uint8)
            tl.store(out_ptr + offs, y)
"""

_CHILD = """
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
import preflight_kernels
from pagedinfer.adapters.kernels.launch import launch, recording_launches
from pagedinfer.adapters.kernels.preflight.compile import compile_launch
from pagedinfer.adapters.kernels.preflight.report import describe_failure
from pagedinfer.adapters.kernels.preflight.run import CheckedLaunch
from pagedinfer.adapters.kernels.prefill_attention import PrefillTiles, paged_prefill_attention
from pagedinfer.adapters.kernels.qk_norm_rope import qk_norm_rope_store
from pagedinfer.adapters.kernels.target import KNOWN_TARGETS

def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")

sm80, sm89, sm90 = KNOWN_TARGETS[80], KNOWN_TARGETS[89], KNOWN_TARGETS[90]
out = {}
with recording_launches(sm90) as launches:
    for fixed in (False, True):
        launch(preflight_kernels.broken_kernel, (1,))(
            meta(64), meta(64, dtype=torch.uint8), 3, BLOCK=64, FIXED=fixed
        )
    for cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        cache = meta(64, 16, 8, 128, dtype=cache_dtype)
        qk_norm_rope_store(
            meta(3, 48 * 128), meta(3, dtype=torch.int64),
            meta(4096, 64, dtype=torch.float32), meta(4096, 64, dtype=torch.float32),
            cache, cache.clone(), meta(3, dtype=torch.int64), num_heads=32, num_kv_heads=8,
            head_dim=128, q_weight=meta(128), k_weight=meta(128),
        )
    # float32 prefill with head dim 256 in sm_90's tiles: more shared memory than sm_89 has.
    paged_prefill_attention(
        meta(512, 16, 256, dtype=torch.float32), meta(64, 16, 16, 256, dtype=torch.float32),
        meta(64, 16, 16, 256, dtype=torch.float32), cu_seqlens_q=meta(3, dtype=torch.int32),
        context_lens=meta(2, dtype=torch.int32), block_tables=meta(2, 32, dtype=torch.int32),
        max_seqlen_q=256, scale=0.0625,
        tiles=PrefillTiles(block_m=64, block_n=32, num_warps=8, num_stages=2),
    )
broken, fixed, e4m3, e5m2, prefill = launches
out["broken"] = compile_launch(broken, sm90, resources=False).error
out["fixed"] = compile_launch(fixed, sm90, resources=False).error
for name, store in (("e4m3", e4m3), ("e5m2", e5m2)):
    result = compile_launch(store, sm90, resources=True)
    out[name] = [result.error, result.registers, result.spill_stores]
    out[name + "_sm80"] = compile_launch(store, sm80, resources=False).error
result = compile_launch(prefill, sm80, resources=False)
checked = CheckedLaunch(result, (sm80, sm89), ("fp32 head dim 256",))
out["prefill"] = [result.error, result.shared, [t.name for t in checked.over_limit()],
                  describe_failure(checked)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def findings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    folder = tmp_path_factory.mktemp("preflight")
    (folder / "preflight_kernels.py").write_text(_KERNELS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    found: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


def test_a_compile_error_is_a_finding(findings: dict[str, object]) -> None:
    error = findings["broken"]
    assert isinstance(error, str) and error.startswith("front end"), error
    assert "uint8" in error
    assert findings["fixed"] is None


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_the_fp8_fused_kv_store_compiles(findings: dict[str, object], fmt: str) -> None:
    error, registers, spills = findings[fmt]  # type: ignore[misc]
    assert error is None
    assert registers > 0 and spills == 0
    assert findings[fmt + "_sm80"] is None


def test_shared_memory_over_a_targets_limit_is_caught(findings: dict[str, object]) -> None:
    error, shared, over, message = findings["prefill"]  # type: ignore[misc]
    assert error is None
    assert 99 * 1024 < shared <= 163 * 1024  # fits sm_80's 163 KiB, not sm_89's 99 KiB
    assert over == ["sm_89"]
    assert "sm_89 has 101376" in message
