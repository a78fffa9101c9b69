"""GPT-OSS's fused experts against their torch twin (float32 and float16, Triton's
interpreter on the CPU): the clamped SwiGLU kernel alone, the grouped GEMMs with per-expert
biases through the whole fused path (with and without the down bias, as tensor-parallel
ranks but the first), and the MoE block built both ways."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS
from pagedinfer.adapters.kernels.clamped_swiglu import clamped_swiglu
from pagedinfer.adapters.kernels.moe import fused_gpt_oss_moe
from pagedinfer.adapters.layers import gpt_oss_moe
from pagedinfer.adapters.layers.gpt_oss_moe import (
    GptOssMoeBlock,
    GptOssRouter,
    gpt_oss_experts_torch,
)

DTYPES = [torch.float32, torch.float16]
ALPHA, LIMIT = 1.702, 7.0
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    # float16: the twin rounds after every op (bias add, clamp, sigmoid, products, each
    # expert's weighted output and the running sum); the kernels keep float32 and round once.
    torch.float16: {"atol": 2e-2, "rtol": 2e-2},
}


def randn(
    *shape: int, dtype: torch.dtype, device: torch.device, seed: int, scale: float = 0.5
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)


def route(
    num_tokens: int, num_experts: int, top_k: int, *, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's routing (top-k logits, softmax over them) of random logits, with expert 0
    never chosen (an idle expert)."""
    logits = randn(num_tokens, num_experts, dtype=torch.float32, device=device, seed=4, scale=1)
    logits[:, 0] = -1e4
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=1).to(dtype), ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("limit", [LIMIT, float("inf")])
def test_clamped_swiglu_matches_the_twin(
    dtype: torch.dtype, limit: float, device: torch.device
) -> None:
    x = randn(6, 2 * 40, dtype=dtype, device=device, seed=0, scale=6.0)
    gate, up = x[:, ::2], x[:, 1::2]
    assert (gate > LIMIT).any() and (up < -LIMIT).any() and (up > LIMIT).any()  # clamps bite
    out = clamped_swiglu(x, ALPHA, limit)
    assert out.shape == (6, 40) and out.dtype == dtype
    expected = gpt_oss_moe.clamped_swiglu(x, ALPHA, limit)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


F32, F16 = torch.float32, torch.float16


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "intermediate", "down_bias", "dtype"),
    [
        (1, 4, 1, 32, 16, True, F32),  # one decode token
        (5, 8, 2, 48, 24, False, F32),  # no down bias: a tensor-parallel rank but the first
        (5, 8, 2, 48, 24, True, F16),
        (9, 8, 4, 32, 40, True, F32),  # intermediate not a power of two; 64-row blocks
        (40, 4, 2, 64, 32, True, F32),  # prefill-sized
        (40, 4, 2, 64, 32, True, F16),
    ],
)
def test_fused_gpt_oss_moe_matches_the_reference(
    dtype: torch.dtype,
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    down_bias: bool,
    device: torch.device,
) -> None:
    e, h, i = num_experts, hidden, intermediate
    x = randn(num_tokens, h, dtype=dtype, device=device, seed=1, scale=1.0)
    gate_up = randn(e, h, 2 * i, dtype=dtype, device=device, seed=2)
    gate_up_bias = randn(e, 2 * i, dtype=dtype, device=device, seed=3)
    down = randn(e, i, h, dtype=dtype, device=device, seed=5, scale=0.1)
    bias = randn(e, h, dtype=dtype, device=device, seed=6) if down_bias else None
    weights, ids = route(num_tokens, e, top_k, dtype=dtype, device=device)
    args = (x, gate_up, gate_up_bias, down, bias, weights, ids)
    expected = gpt_oss_experts_torch(*args, alpha=ALPHA, limit=LIMIT)
    result = fused_gpt_oss_moe(*args, alpha=ALPHA, limit=LIMIT)
    assert result.dtype == dtype and result.shape == (num_tokens, h)
    torch.testing.assert_close(result, expected, **TOLERANCE[dtype])


def test_no_tokens(device: torch.device) -> None:
    x = torch.empty(0, 32, device=device)
    ids = torch.empty(0, 2, dtype=torch.int64, device=device)
    out = fused_gpt_oss_moe(
        x, torch.randn(4, 32, 32, device=device), torch.randn(4, 32, device=device),
        torch.randn(4, 16, 32, device=device), None, torch.empty(0, 2, device=device), ids,
        alpha=ALPHA, limit=LIMIT,
    )  # fmt: skip
    assert out.shape == (0, 32)


def test_moe_block_fused_and_reference_agree(device: torch.device) -> None:
    dtype = torch.float32
    blocks = [
        GptOssMoeBlock(
            48,
            32,
            num_experts=8,
            top_k=2,
            alpha=ALPHA,
            limit=LIMIT,
            fused=fused,
            parallel=SINGLE_PROCESS,
            dtype=dtype,
            device=device,
        )
        for fused in (False, True)
    ]
    assert blocks[0].experts.run_experts is gpt_oss_experts_torch
    assert blocks[1].experts.run_experts is fused_gpt_oss_moe
    for index, (name, param) in enumerate(blocks[0].named_parameters()):
        param.data.copy_(randn(*param.shape, dtype=dtype, device=device, seed=index, scale=0.2))
        blocks[1].get_parameter(name).data.copy_(param)
    x = randn(9, 48, dtype=dtype, device=device, seed=20, scale=1.0)
    with torch.no_grad():
        torch.testing.assert_close(blocks[1](x), blocks[0](x), **TOLERANCE[dtype])


def test_the_fused_path_never_reads_the_device() -> None:
    """On meta tensors (shapes only: any read to the host raises) the fused path still
    issues its launches: sorting by expert and the grouped GEMMs need no host sync, so the
    block can be captured in a CUDA graph."""
    from pagedinfer.adapters.kernels.launch import recording_launches
    from pagedinfer.adapters.kernels.target import KNOWN_TARGETS

    meta = torch.device("meta")
    router = GptOssRouter(64, 8, 4, dtype=torch.bfloat16, device=meta)
    x = torch.empty(16, 64, dtype=torch.bfloat16, device=meta)
    weights, ids = router(x)
    e, h, i = 8, 64, 96
    with recording_launches(KNOWN_TARGETS[90]) as launches:
        out = fused_gpt_oss_moe(
            x, torch.empty(e, h, 2 * i, dtype=torch.bfloat16, device=meta),
            torch.empty(e, 2 * i, dtype=torch.bfloat16, device=meta),
            torch.empty(e, i, h, dtype=torch.bfloat16, device=meta),
            torch.empty(e, h, dtype=torch.bfloat16, device=meta), weights, ids,
            alpha=ALPHA, limit=LIMIT,
        )  # fmt: skip
    assert out.shape == (16, 64)
    names = [launch.name for launch in launches]
    assert names == ["_grouped_gemm_kernel", "_clamped_swiglu_kernel", "_grouped_gemm_kernel"]
    first, _, second = (launch.constexpr_values() for launch in launches)
    assert first["HAS_BIAS"] and not first["MUL_WEIGHT"]
    assert second["HAS_BIAS"] and second["MUL_WEIGHT"]
