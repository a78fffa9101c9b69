"""Quantized checkpoints on a GPU: the FP8 and int4 GEMMs compiled, and engines using them.

Kernels: Qwen3-0.6B's projection shapes (q/k/v 4096 x 1024, o 1024 x 2048, gate/up
6144 x 1024, down 1024 x 3072) in bfloat16 and float16, from one decode row to a long
prefill, against the dequantized weight through ``F.linear`` in float32; both inside a
captured CUDA graph. Engines: each format of ``quantized_checkpoint`` on the Triton path
(float32, CUDA graphs) gives the greedy tokens of its dequantized reference, and a bfloat16
FP8 model keeps its weights in FP8 (half the bytes). Run with ``make test-gpu``; FP8 needs
compute capability 8.9+ (elsewhere FP8 layers are dequantized at load, also checked).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.layers.linear import LinearBase
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.adapters.models.quantized_checkpoint import QuantFormat, write_quantized_checkpoint
from pagedinfer.adapters.quantization.fp8 import dequantize_fp8, fp8_kernel_available, quantize_fp8
from pagedinfer.adapters.quantization.int4 import (
    SEQUENTIAL_POSITIONS,
    Int4Weights,
    dequantize_int4,
    pack_int4,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
# (N, K) of Qwen3-0.6B's projections.
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
DTYPES = [torch.bfloat16, torch.float16]
ROWS = [1, 7, 256, 3000]


def needs_fp8() -> None:
    if not fp8_kernel_available(CUDA):
        pytest.skip("Triton's e4m3 conversion needs compute capability 8.9+")


def close(out: torch.Tensor, reference: torch.Tensor) -> None:
    """Activations and output in 16 bits, float32 accumulation: errors of a few ulps of the
    outputs' magnitude (the reference multiplies the unrounded activations in float32)."""
    scale = float(reference.abs().max())
    torch.testing.assert_close(out.float(), reference, atol=scale * 2e-2, rtol=2e-2)


def fp8_inputs(n: int, k: int, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=generator) * k**-0.5
    quantized, scale = quantize_fp8(weight, (128, 128))
    x = torch.randn(rows, k, generator=generator).to(dtype)
    return x.to(CUDA), quantized.to(CUDA), scale.to(CUDA)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_fp8_gemm_at_qwen3_0_6b_size(n: int, k: int, rows: int, dtype: torch.dtype) -> None:
    needs_fp8()
    from pagedinfer.adapters.kernels.fp8_gemm import fp8_gemm

    x, quantized, scale = fp8_inputs(n, k, rows, dtype)
    out = fp8_gemm(x, quantized, scale, block_n=128, block_k=128)
    reference = F.linear(x.float(), dequantize_fp8(quantized, scale, (128, 128)))
    assert out.dtype == dtype
    close(out, reference)


def int4_inputs(
    n: int, k: int, rows: int, dtype: torch.dtype, act_order: bool
) -> tuple[Int4Weights, torch.Tensor]:
    generator = torch.Generator().manual_seed(n * k)
    groups = k // 128
    g_idx = torch.arange(k) // 128
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=generator)]
    weights = Int4Weights(
        q=torch.randint(0, 16, (k, n), generator=generator),
        zeros=torch.randint(0, 16, (groups, n), generator=generator),
        scales=torch.rand(groups, n, generator=generator) * 0.02,
        g_idx=g_idx,
    )
    return weights, torch.randn(rows, k, generator=generator).to(dtype).to(CUDA)


def int4_gemm_of(weights: Int4Weights, x: torch.Tensor) -> torch.Tensor:
    from pagedinfer.adapters.kernels.int4_gemm import int4_gemm

    out: torch.Tensor = int4_gemm(
        x,
        pack_int4(weights.q, 0, SEQUENTIAL_POSITIONS).to(CUDA),
        weights.zeros.to(torch.uint8).to(CUDA),
        weights.scales.float().to(CUDA),
        weights.g_idx.to(torch.int32).to(CUDA),
    )
    return out


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int4_gemm_at_qwen3_0_6b_size(
    n: int, k: int, rows: int, dtype: torch.dtype, act_order: bool
) -> None:
    weights, x = int4_inputs(n, k, rows, dtype, act_order)
    out = int4_gemm_of(weights, x)
    reference = F.linear(x.float(), dequantize_int4(weights).to(CUDA))
    assert out.dtype == dtype
    close(out, reference)


def test_quantized_gemms_inside_a_cuda_graph() -> None:
    """Split-K partial sums and all: nothing waits for the host."""
    from pagedinfer.adapters.kernels.fp8_gemm import fp8_gemm

    has_fp8 = fp8_kernel_available(CUDA)
    weights, x = int4_inputs(1024, 3072, 8, torch.bfloat16, act_order=True)
    _, quantized, scale = fp8_inputs(1024, 3072, 8, torch.bfloat16)

    def run() -> tuple[torch.Tensor, torch.Tensor | None]:
        fp8 = fp8_gemm(x, quantized, scale, block_n=128, block_k=128) if has_fp8 else None
        return int4_gemm_of(weights, x), fp8

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        int4_out, fp8_out = run()
    x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).to(x))
    graph.replay()
    torch.cuda.synchronize()
    close(int4_out, F.linear(x.float(), dequantize_int4(weights).to(CUDA)))
    if fp8_out is not None:
        close(fp8_out, F.linear(x.float(), dequantize_fp8(quantized, scale, (128, 128))))


# ---------------------------------------------------------------- engines

# q/k/v and gate/up in whole 128-blocks and groups; 2 layers.
MODEL: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
FORMATS: dict[str, tuple[QuantFormat, dict[str, Any]]] = {
    "fp8": ("fp8", {"block": (128, 128)}),
    "ct-channel": ("compressed-tensors", {"block": None}),
    "awq": ("awq", {"group_size": 128}),
    "gptq-act-order": ("gptq", {"group_size": 128, "desc_act": True}),
}


def greedy(path: Path, prompts: list[list[int]], **settings: Any) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with Engine(path, device="cuda", kv_block_size=16, max_model_len=256, **settings) as engine:
        runner = engine._executor
        assert isinstance(runner, ModelRunner) and runner.backend.name != "torch"
        outputs = engine.generate(prompts, params, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantized_engine_gives_the_reference_tokens(
    make_checkpoint: Callable[..., Path], tmp_path: Path, name: str
) -> None:
    """float32 (IEEE dots in the GEMMs), CUDA graphs on: the dequantized reference's tokens."""
    fmt, options = FORMATS[name]
    quantized = write_quantized_checkpoint(
        make_checkpoint("tiny", **MODEL),
        tmp_path / "quantized",
        fmt,
        reference=tmp_path / "reference",
        **options,
    )
    rng = random.Random(11)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 90))] for _ in range(8)]
    expected = greedy(tmp_path / "reference", prompts, dtype="float32")
    assert greedy(quantized, prompts, dtype="float32") == expected


def test_fp8_weights_stay_fp8_on_the_gpu(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """bfloat16 model: every quantized projection holds FP8 weights (the kernel path on
    8.9+, dequantized below), and the engine generates."""
    source = make_checkpoint("tiny", dtype="bfloat16", **MODEL)
    path = write_quantized_checkpoint(source, tmp_path / "fp8", "fp8", block=(128, 128))
    with Engine(path, device="cuda", kv_block_size=16, max_model_len=256) as engine:
        runner = engine._executor
        assert isinstance(runner, ModelRunner)
        layers = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
        on_kernel = [layer.matmul is not None for layer in layers]
        assert all(on_kernel) == fp8_kernel_available(CUDA) and any(on_kernel) == all(on_kernel)
        if all(on_kernel):
            for layer in layers:
                assert layer.matmul is not None
                assert layer.matmul.get_parameter("weight").dtype == torch.float8_e4m3fn
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        output = engine.generate([[1, 2, 3, 4]], params, use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 8
