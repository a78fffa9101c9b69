"""The skinny split-K GEMM against its torch twin (``F.linear``), its per-shape choice, and
``LinearBase``'s dispatch to it.

Kernel: float32 (IEEE dots) and float16, one to forty rows, N and K not multiples of the
tiles, one to four K splits (forced: off CUDA the plan picks one), bias on and off, leading
dimensions and an empty batch. The choice: decode shapes of Qwen3-0.6B on a 132-SM GPU.
Dispatch: on the CPU a layer built for the kernel still runs ``F.linear`` (bit for bit), and
where the choice says so it runs the kernel.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.kernels import skinny_gemm as kernel
from pagedinfer.adapters.kernels.skinny_gemm import (
    BLOCK_K,
    prefers_skinny_gemm,
    skinny_gemm,
    skinny_gemm_wins,
)
from pagedinfer.adapters.kernels.split_k import plan_split_k
from pagedinfer.adapters.layers.linear import RowParallelLinear

DTYPES = [torch.float32, torch.float16]


def tolerance(dtype: torch.dtype, reference: torch.Tensor) -> dict[str, Any]:
    """float32: another summation order; float16: the activations' and output's rounding."""
    if dtype == torch.float32:
        return {"atol": 1e-4, "rtol": 1e-4}
    return {"atol": float(reference.abs().max()) * 2e-3, "rtol": 2e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("rows", "n", "k", "split_k", "splits"),
    [
        (1, 96, 200, 3, 2),  # decode row; N and K not multiples of the tiles; 4 K steps in 2
        (5, 64, 256, 4, 4),  # one K step per split
        (20, 130, 160, 2, 2),  # 32-row tiles, a partial last N tile, a partial last K step
        (40, 72, 96, 1, 1),  # 64-row tiles, one split: written in x's dtype directly
        (3, 40, 48, 1, 1),  # K shorter than one step
    ],
)
def test_skinny_gemm_matches_linear(
    device: torch.device,
    dtype: torch.dtype,
    bias: bool,
    rows: int,
    n: int,
    k: int,
    split_k: int,
    splits: int,
) -> None:
    generator = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    b = torch.randn(n, generator=generator).to(dtype) if bias else None
    launch = plan_split_k(x, rows, n, k, BLOCK_K, split_k)
    assert launch.splits == splits  # the cases cover what they say they do
    out = skinny_gemm(
        x.to(device),
        weight.to(device),
        None if b is None else b.to(device),
        split_k=split_k,
    )
    assert out.dtype == dtype and out.shape == (rows, n)
    reference = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(out.float().cpu(), reference, **tolerance(dtype, reference))


def test_skinny_gemm_keeps_leading_dims_and_takes_empty_batches(device: torch.device) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=generator)
    x = torch.randn(2, 3, 128, generator=generator)
    b = torch.randn(64, generator=generator)
    out = skinny_gemm(x.to(device), weight.to(device), b.to(device), split_k=2)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out.cpu(), F.linear(x, weight, b), atol=1e-4, rtol=1e-4)
    columns = torch.randn(128, 4, generator=generator).t()  # rows not contiguous in K
    torch.testing.assert_close(
        skinny_gemm(columns.to(device), weight.to(device)).cpu(),
        F.linear(columns, weight),
        atol=1e-4,
        rtol=1e-4,
    )
    empty = skinny_gemm(torch.empty(0, 128, device=device), weight.to(device))
    assert empty.shape == (0, 64)


def test_the_choice_takes_decode_shapes_with_few_output_tiles() -> None:
    sms = 132  # an H100
    hidden, intermediate, qkv = 1024, 3072, 4096  # Qwen3-0.6B
    # o (N 1024, K 2048) and down (N 1024, K 3072): 16 column tiles, 4 row tiles at 256 rows.
    for rows in (1, 16, 64, 256):
        assert skinny_gemm_wins(rows, hidden, 2048, sms)
        assert skinny_gemm_wins(rows, hidden, intermediate, sms)
    # qkv (N 4096): 64 column tiles, so two row tiles of 64 at most.
    assert skinny_gemm_wins(128, qkv, hidden, sms)
    assert not skinny_gemm_wins(129, qkv, hidden, sms)
    # gate_up (N 6144): 96 column tiles, one row tile at most.
    assert skinny_gemm_wins(64, 2 * intermediate, hidden, sms)
    assert not skinny_gemm_wins(65, 2 * intermediate, hidden, sms)
    # The LM head (N 151936) has tiles to spare; prefill has rows to spare.
    assert not skinny_gemm_wins(1, 151936, hidden, sms)
    assert not skinny_gemm_wins(257, hidden, 2048, sms)
    assert not skinny_gemm_wins(0, hidden, 2048, sms)
    assert not skinny_gemm_wins(16, hidden, 64, sms)  # one K step: nothing to split
    assert not skinny_gemm_wins(256, hidden, 2048, 64)  # 64 tiles fill a 64-SM GPU


def test_the_choice_keeps_the_cpu_on_linear() -> None:
    weight = torch.randn(64, 256)
    assert not prefers_skinny_gemm(torch.randn(4, 256), weight)  # CPU
    assert not prefers_skinny_gemm(torch.randn(4, 256).half(), weight.half())  # CPU


def layer(skinny: bool, bias: bool) -> RowParallelLinear:
    built = RowParallelLinear(
        256,
        96,
        parallel=ParallelContext(),
        dtype=torch.float32,
        device=torch.device("cpu"),
        bias=bias,
        skinny_gemm=skinny,
    )
    generator = torch.Generator().manual_seed(1)
    built.weight.data.copy_(torch.randn(96, 256, generator=generator))
    if built.bias is not None:
        built.bias.data.copy_(torch.randn(96, generator=generator))
    return built


@pytest.mark.parametrize("bias", [False, True])
def test_a_layer_on_the_cpu_runs_linear_bit_for_bit(bias: bool) -> None:
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    built = layer(skinny=True, bias=bias)
    assert built._skinny is not None  # built for the kernel, which the CPU never runs
    assert torch.equal(built(x), F.linear(x, built.weight, built.bias))


def test_a_layer_runs_the_kernel_where_the_choice_says_so(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    if device.type != "cpu":
        pytest.skip("the interpreter's check of the dispatch")
    calls: list[tuple[int, ...]] = []

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return skinny_gemm(x, weight, bias, split_k=2)

    monkeypatch.setattr(kernel, "prefers_skinny_gemm", lambda x, weight: x.shape[0] <= 4)
    monkeypatch.setattr(kernel, "skinny_gemm", counted)
    built = layer(skinny=True, bias=True)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(3))
    reference = F.linear(x, built.weight, built.bias)
    torch.testing.assert_close(built(x[:4]), reference[:4], atol=1e-4, rtol=1e-4)
    assert calls == [(4, 256)]
    assert torch.equal(built(x), reference)  # six rows: the choice says no, F.linear runs
    assert calls == [(4, 256)]
