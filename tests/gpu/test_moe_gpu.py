"""The fused MoE kernel compiled for a real GPU, and Qwen3-MoE engines on it.

Kernel: Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts of 768, top 8) in bf16 and
fp16 against the torch reference experts, from one decode token to a long prefill, and inside
a captured CUDA graph (the kernel never waits for the host). Engine: a tiny random Qwen3-MoE
in float32 on the GPU (Triton path, fused experts, CUDA graphs) gives transformers' greedy
tokens. Run with ``make test-gpu``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hf_reference import hf_greedy
from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.layers.mlp import moe_experts_torch, select_experts
from pagedinfer.adapters.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 2048, 768, 128, 8
DTYPES = [torch.bfloat16, torch.float16]
TOLERANCE = {
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
}


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    return (torch.randn(*shape, generator=generator, device=CUDA) * scale).to(dtype)


def expert_inputs(
    num_tokens: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x = randn(num_tokens, HIDDEN, dtype=dtype, seed=0)
    w13 = randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, dtype=dtype, seed=1, scale=HIDDEN**-0.5)
    w2 = randn(EXPERTS, HIDDEN, INTERMEDIATE, dtype=dtype, seed=2, scale=INTERMEDIATE**-0.5)
    logits = randn(num_tokens, EXPERTS, dtype=dtype, seed=3)
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 3000])
def test_fused_moe_at_qwen3_30b_a3b_size(dtype: torch.dtype, num_tokens: int) -> None:
    from pagedinfer.adapters.kernels.moe import fused_moe

    inputs = expert_inputs(num_tokens, dtype)
    expected = moe_experts_torch(*inputs)
    torch.testing.assert_close(fused_moe(*inputs), expected, **TOLERANCE[dtype])


def test_fused_moe_inside_a_cuda_graph() -> None:
    from pagedinfer.adapters.kernels.moe import fused_moe

    x, w13, w2, weights, ids = expert_inputs(16, torch.bfloat16)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    # New inputs and routing, copied into the captured tensors, then replayed.
    x.copy_(randn(16, HIDDEN, dtype=torch.bfloat16, seed=7))
    weights.copy_(weights.flip(0).clone())
    ids.copy_(ids.flip(0).clone())
    graph.replay()
    torch.cuda.synchronize()
    expected = moe_experts_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])


def test_moe_engine_on_the_gpu_matches_transformers(make_checkpoint: Callable[..., Path]) -> None:
    checkpoint = make_checkpoint(
        "tiny", architecture="Qwen3MoeForCausalLM", num_experts=8, mlp_only_layers=(1,)
    )
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 90))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with Engine(
        checkpoint, device="cuda", dtype="float32", kv_block_size=16, max_model_len=256
    ) as engine:
        runner = engine._executor
        assert isinstance(runner, ModelRunner)
        assert runner.backend.name != "torch"  # the fused MoE path
        outputs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(checkpoint, prompt, 12)
