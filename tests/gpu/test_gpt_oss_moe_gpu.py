"""GPT-OSS's fused experts compiled for a real GPU, and a GPT-OSS engine on it.

Kernel: GPT-OSS-20B's expert shapes (hidden 2880, 32 experts of 2880, top 4, biased, clamped
SwiGLU) in bf16 against the torch reference experts (in float32), from one decode token to a
prefill, with and without the down bias, and inside a captured CUDA graph (the fused path
never waits for the host). Engine: a tiny random GPT-OSS (sinks, sliding and full layers,
the biased MoE) in float32 on the GPU (Triton path, fused experts, CUDA graphs) gives
transformers' greedy tokens, from a dense checkpoint and from an MXFP4 one (its experts
dequantized at load on the CPU, then copied to the GPU). Run with ``make test-gpu``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hf_reference import hf_greedy
from mxfp4_checkpoint import GPT_OSS, write_mxfp4_pair
from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.layers.gpt_oss_moe import gpt_oss_experts_torch
from pagedinfer.adapters.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 2880, 2880, 32, 4
ALPHA, LIMIT = 1.702, 7.0
# Against the reference in float32 on the same bf16 values: the kernels round the gate/up
# projection, the activation and each pair's weighted output to bf16 and sum a token's k
# outputs in bf16. Outputs up to ~8 (a bf16 ulp there is 0.03). A CPU emulation of those
# roundings at this size: relative error 3.6e-3 (norm), at most 0.04 per element; the bf16
# reference itself is further off (5.5e-3, 0.05).
TOLERANCE = {"atol": 6e-2, "rtol": 3e-2}
MAX_RELATIVE_ERROR = 1e-2

Inputs = tuple[torch.Tensor, ...]


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    return (torch.randn(*shape, generator=generator, device=CUDA) * scale).to(torch.bfloat16)


def expert_weights() -> Inputs:
    e, h, i = EXPERTS, HIDDEN, INTERMEDIATE
    return (
        randn(e, h, 2 * i, seed=1, scale=2.5 * h**-0.5),  # gate/up ~ N(0, 2.5): clamps bite
        randn(e, 2 * i, seed=2, scale=0.5),
        randn(e, i, h, seed=3, scale=0.5 * i**-0.5),
        randn(e, h, seed=4, scale=0.5),
    )


def reference(*args: torch.Tensor | None) -> torch.Tensor:
    """The torch experts in float32 (ids stay int64)."""
    wide = [a if a is None or not a.is_floating_point() else a.float() for a in args]
    x, gate_up, gate_up_bias, down, bias, weights, ids = wide
    assert x is not None and gate_up is not None and gate_up_bias is not None
    assert down is not None and weights is not None and ids is not None
    return gpt_oss_experts_torch(
        x, gate_up, gate_up_bias, down, bias, weights, ids, alpha=ALPHA, limit=LIMIT
    )


def check(result: torch.Tensor, expected: torch.Tensor) -> None:
    assert result.dtype == torch.bfloat16
    error = (result.float() - expected).norm() / expected.norm()
    assert error < MAX_RELATIVE_ERROR, f"relative error {error:.2e}"
    torch.testing.assert_close(result.float(), expected, **TOLERANCE)


def routing(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.topk(randn(num_tokens, EXPERTS, seed=seed), TOP_K, dim=-1)
    return torch.softmax(values, dim=1, dtype=values.dtype), ids


@pytest.fixture(scope="module")
def weights() -> Inputs:
    return expert_weights()


@pytest.mark.parametrize("down_bias", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 2000])
def test_fused_gpt_oss_moe_at_gpt_oss_20b_size(
    weights: Inputs, num_tokens: int, down_bias: bool
) -> None:
    from pagedinfer.adapters.kernels.moe import fused_gpt_oss_moe

    gate_up, gate_up_bias, down, bias = weights
    x = randn(num_tokens, HIDDEN, seed=0)
    topk_weights, ids = routing(num_tokens, seed=5)
    args = (x, gate_up, gate_up_bias, down, bias if down_bias else None, topk_weights, ids)
    check(fused_gpt_oss_moe(*args, alpha=ALPHA, limit=LIMIT), reference(*args))


def test_fused_gpt_oss_moe_inside_a_cuda_graph(weights: Inputs) -> None:
    from pagedinfer.adapters.kernels.moe import fused_gpt_oss_moe

    gate_up, gate_up_bias, down, bias = weights
    x = randn(16, HIDDEN, seed=0)
    topk_weights, ids = routing(16, seed=5)
    args = (x, gate_up, gate_up_bias, down, bias, topk_weights, ids)
    fused_gpt_oss_moe(*args, alpha=ALPHA, limit=LIMIT)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_gpt_oss_moe(*args, alpha=ALPHA, limit=LIMIT)
    # New inputs and routing, copied into the captured tensors, then replayed.
    new_weights, new_ids = routing(16, seed=9)
    x.copy_(randn(16, HIDDEN, seed=7))
    topk_weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    check(out, reference(*args))


def check_engine(checkpoint: Path, reference: Path) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 60))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with Engine(
        checkpoint, device="cuda", dtype="float32", kv_block_size=16, max_model_len=128
    ) as engine:
        runner = engine._executor
        assert isinstance(runner, ModelRunner)
        assert runner.backend.name != "torch"  # the fused MoE path
        outputs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(reference, prompt, 12)


def test_gpt_oss_engine_on_the_gpu_matches_transformers(
    make_checkpoint: Callable[..., Path],
) -> None:
    checkpoint = make_checkpoint("tiny", **GPT_OSS)
    check_engine(checkpoint, checkpoint)


def test_mxfp4_gpt_oss_on_the_gpu_matches_transformers_on_the_dequantized_model(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    write_mxfp4_pair(make_checkpoint("tiny", **GPT_OSS), tmp_path / "mxfp4", tmp_path / "ref")
    check_engine(tmp_path / "mxfp4", tmp_path / "ref")
