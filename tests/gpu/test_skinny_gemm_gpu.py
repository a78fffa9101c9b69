"""The skinny split-K GEMM compiled on a GPU, at Qwen3-0.6B's decode shapes.

Kernel: the qkv (4096 x 1024), o (1024 x 2048), gate_up (6144 x 1024) and down (1024 x 3072)
projections at 1, 16, 64 and 256 rows in bfloat16, against ``F.linear`` (cuBLAS) in bfloat16,
with the split the plan chooses on this GPU (and a bias once). Dispatch: a dense layer built
for the kernel takes it for the o-projection at decode, inside a captured CUDA graph (no host
sync), and replays it on new inputs. Run with ``make test-gpu``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.layers.linear import RowParallelLinear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
# (N, K) of Qwen3-0.6B's projections: qkv, o, gate_up, down.
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
ROWS = [1, 16, 64, 256]


def inputs(n: int, k: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(n + k + rows)
    weight = torch.randn(n, k, generator=generator) * k**-0.5
    x = torch.randn(rows, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    x, weight, bias = (t.to(torch.bfloat16).to(CUDA) for t in (x, weight, bias))
    return x, weight, bias


def close(out: torch.Tensor, reference: torch.Tensor) -> None:
    """Both in bfloat16 from float32 sums in another order: a few ulps of the outputs."""
    scale = float(reference.float().abs().max())
    torch.testing.assert_close(out.float(), reference.float(), atol=scale * 2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_skinny_gemm_matches_cublas_at_qwen3_0_6b_decode(n: int, k: int, rows: int) -> None:
    from pagedinfer.adapters.kernels.skinny_gemm import skinny_gemm

    x, weight, _ = inputs(n, k, rows)
    out = skinny_gemm(x, weight)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    close(out, F.linear(x, weight))


def test_skinny_gemm_adds_the_bias_once_over_its_splits() -> None:
    from pagedinfer.adapters.kernels.skinny_gemm import BLOCK_K, skinny_gemm
    from pagedinfer.adapters.kernels.split_k import plan_split_k

    x, weight, bias = inputs(1024, 3072, 256)
    assert plan_split_k(x, 256, 1024, 3072, BLOCK_K, None).splits > 1  # the plan splits here
    close(skinny_gemm(x, weight, bias), F.linear(x, weight, bias))


def test_a_decode_layer_takes_the_kernel_inside_a_cuda_graph() -> None:
    from pagedinfer.adapters.kernels.skinny_gemm import prefers_skinny_gemm

    layer = RowParallelLinear(
        2048,
        1024,
        parallel=ParallelContext(),
        dtype=torch.bfloat16,
        device=CUDA,
        bias=True,
        skinny_gemm=True,
    )
    x, weight, bias = inputs(1024, 2048, 16)
    layer.weight.data.copy_(weight)
    assert layer.bias is not None
    layer.bias.data.copy_(bias)
    assert prefers_skinny_gemm(x, layer.weight)  # 16 output tiles: the kernel's shape
    static_x = x.clone()
    layer(static_x)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    for seed in range(3):
        fresh = torch.randn(16, 2048, generator=torch.Generator().manual_seed(seed))
        static_x.copy_(fresh.to(torch.bfloat16))
        graph.replay()
        close(static_out, F.linear(static_x, weight, bias))
