"""The quantized GEMMs against their torch twins: dequantize, then ``F.linear``.

``fp8_gemm``: FP8 (e4m3) weights with 128x128, 64x32 and per-channel scales, partial last
blocks, split K; ``int4_gemm``: 4-bit weights in the kernels' layout with sequential groups,
act-order ``g_idx`` and one group, split K. float32 (IEEE dots) and float16 activations.
Triton's interpreter runs the FP8 loads and conversions too (e4m3 -> float), so the same
code path as on a GPU is checked, FP8 included.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagedinfer.adapters.kernels.fp8_gemm import fp8_gemm, fp8_gemm_blocks
from pagedinfer.adapters.kernels.int4_gemm import int4_gemm
from pagedinfer.adapters.quantization.fp8 import dequantize_fp8, quantize_fp8
from pagedinfer.adapters.quantization.int4 import (
    SEQUENTIAL_POSITIONS,
    Int4Weights,
    dequantize_int4,
    pack_int4,
)

DTYPES = [torch.float32, torch.float16]


def tolerance(dtype: torch.dtype, reference: torch.Tensor) -> dict[str, Any]:
    """float32: another summation order; float16: the activations' and output's rounding
    (outputs are sums of ~200 O(1) products: a few float16 ulps of their magnitude)."""
    if dtype == torch.float32:
        return {"atol": 1e-4, "rtol": 1e-4}
    return {"atol": float(reference.abs().max()) * 2e-3, "rtol": 2e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "n", "k", "block", "split_k"),
    [
        (1, 256, 256, (128, 128), 1),  # decode row, whole blocks
        (5, 200, 320, (128, 128), 2),  # partial last blocks along N and K, split K
        (33, 96, 160, (64, 32), 3),  # several row tiles, K steps of 32
        (7, 72, 200, None, 1),  # per-channel scales ([N, 1]): one block spans K
        (3, 64, 96, None, 4),
    ],
)
def test_fp8_gemm_matches_dequantized_linear(
    device: torch.device,
    dtype: torch.dtype,
    rows: int,
    n: int,
    k: int,
    block: tuple[int, int] | None,
    split_k: int,
) -> None:
    generator = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=generator)
    quantized, scale = quantize_fp8(weight, block)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    block_n, block_k = block if block is not None else (1, k)
    out = fp8_gemm(
        x.to(device),
        quantized.to(device),
        scale.to(device),
        block_n=block_n,
        block_k=block_k,
        split_k=split_k,
    )
    assert out.dtype == dtype and out.shape == (rows, n)
    reference = F.linear(x.float(), dequantize_fp8(quantized, scale, block))
    torch.testing.assert_close(out.float().cpu(), reference, **tolerance(dtype, reference))


def test_fp8_gemm_keeps_leading_dims_and_takes_empty_batches(device: torch.device) -> None:
    quantized, scale = quantize_fp8(torch.randn(64, 128), (64, 64))
    x = torch.randn(2, 3, 128)
    out = fp8_gemm(x.to(device), quantized.to(device), scale.to(device), block_n=64, block_k=64)
    reference = F.linear(x, dequantize_fp8(quantized, scale, (64, 64)))
    torch.testing.assert_close(out.cpu(), reference, atol=1e-4, rtol=1e-4)
    empty = fp8_gemm(
        torch.empty(0, 128, device=device),
        quantized.to(device),
        scale.to(device),
        block_n=64,
        block_k=64,
    )
    assert empty.shape == (0, 64)


def test_fp8_k_steps_stay_inside_one_scale_block() -> None:
    assert fp8_gemm_blocks(128, 1024) == 128
    assert fp8_gemm_blocks(96, 1024) == 32
    assert fp8_gemm_blocks(2048, 1024) == 64  # one block spans K: any step
    assert fp8_gemm_blocks(40, 1024) is None  # no multiple of 16 divides 40


def int4_weights(n: int, k: int, group_size: int | None, act_order: bool, seed: int) -> Int4Weights:
    generator = torch.Generator().manual_seed(seed)
    groups = 1 if group_size is None else -(-k // group_size)
    g_idx = torch.arange(k) // (group_size or k)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=generator)]
    return Int4Weights(
        q=torch.randint(0, 16, (k, n), generator=generator),
        zeros=torch.randint(0, 17, (groups, n), generator=generator),
        scales=torch.rand(groups, n, generator=generator) * 0.2,
        g_idx=g_idx,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "n", "k", "group_size", "act_order", "split_k"),
    [
        (1, 128, 256, 128, False, 1),  # decode row
        (6, 72, 192, 64, False, 3),  # N not a multiple of the tile, split K
        (20, 64, 160, 32, True, 2),  # act-order: any group for any input feature
        (3, 40, 96, None, False, 1),  # one group (GPTQ group_size -1)
        (17, 64, 200, 64, True, 1),  # K not a multiple of the K step; a partial group
    ],
)
def test_int4_gemm_matches_dequantized_linear(
    device: torch.device,
    dtype: torch.dtype,
    rows: int,
    n: int,
    k: int,
    group_size: int | None,
    act_order: bool,
    split_k: int,
) -> None:
    weights = int4_weights(n, k, group_size, act_order, seed=rows + n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    out = int4_gemm(
        x.to(device),
        pack_int4(weights.q, 0, SEQUENTIAL_POSITIONS).to(device),
        weights.zeros.to(torch.uint8).to(device),
        weights.scales.float().to(device),
        weights.g_idx.to(torch.int32).to(device),
        split_k=split_k,
    )
    assert out.dtype == dtype and out.shape == (rows, n)
    reference = F.linear(x.float(), dequantize_int4(weights))
    torch.testing.assert_close(out.float().cpu(), reference, **tolerance(dtype, reference))
