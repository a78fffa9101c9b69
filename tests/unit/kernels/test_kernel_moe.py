"""The fused MoE kernel against the torch reference experts (float32 and float16).

The alignment step (pairs sorted by expert, each expert's run padded to whole blocks) is
checked on its own; then the whole fused path, and the MoE block built both ways.
"""

from __future__ import annotations

import pytest
import torch

from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS
from pagedinfer.adapters.kernels.moe import align_by_expert, fused_moe
from pagedinfer.adapters.layers.mlp import SparseMoeBlock, moe_experts_torch, select_experts

DTYPES = [torch.float32, torch.float16]
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    # float16: the reference rounds each expert's output, its weighted value and every partial
    # sum to float16; the kernel keeps those in float32 and rounds once. Outputs are O(1), so
    # two or three float16 ulps.
    torch.float16: {"atol": 1e-2, "rtol": 1e-2},
}


def randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * 0.5).to(device, dtype)


def routing(
    num_tokens: int, num_experts: int, top_k: int, *, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing of random logits, with expert 0 never chosen (an idle expert)."""
    logits = randn(num_tokens, num_experts, dtype=torch.float32, device=device, seed=seed)
    logits[:, 0] = -1e4
    return select_experts(logits, top_k, renormalize=True)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 1), (7, 2), (40, 3)])
def test_alignment_groups_pairs_by_expert_in_whole_blocks(
    num_tokens: int, top_k: int, block_m: int, device: torch.device
) -> None:
    num_experts = 6
    _, ids = routing(num_tokens, num_experts, top_k, device=device, seed=num_tokens)
    sorted_ids, expert_ids, num_padded = align_by_expert(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    flat = ids.flatten().tolist()
    used = int(num_padded.item())
    assert used % block_m == 0 and used <= sorted_ids.numel()
    rows = sorted_ids.tolist()
    assert sorted(row for row in rows if row < num_pairs) == list(range(num_pairs))
    assert all(row == num_pairs for row in rows[used:])  # beyond the used part: padding only
    counts = [flat.count(expert) for expert in range(num_experts)]
    assert used == sum(-(-count // block_m) * block_m for count in counts)
    for block in range(used // block_m):
        expert = int(expert_ids[block])
        members = [row for row in rows[block * block_m : (block + 1) * block_m] if row < num_pairs]
        assert members, "a used block holds at least one pair"
        assert all(flat[row] == expert for row in members)
        assert members == sorted(members)  # pair order kept within an expert


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "intermediate"),
    [(1, 4, 1, 32, 16), (5, 8, 2, 48, 24), (33, 8, 3, 32, 40), (70, 4, 2, 64, 32)],
)
def test_fused_moe_matches_the_reference(
    dtype: torch.dtype,
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    device: torch.device,
) -> None:
    x = randn(num_tokens, hidden, dtype=dtype, device=device, seed=1)
    w13 = randn(num_experts, 2 * intermediate, hidden, dtype=dtype, device=device, seed=2)
    w2 = randn(num_experts, hidden, intermediate, dtype=dtype, device=device, seed=3)
    weights, ids = routing(num_tokens, num_experts, top_k, device=device, seed=4)
    weights = weights.to(dtype)
    expected = moe_experts_torch(x, w13, w2, weights, ids)
    result = fused_moe(x, w13, w2, weights, ids)
    assert result.dtype == dtype and result.shape == (num_tokens, hidden)
    torch.testing.assert_close(result, expected, **TOLERANCE[dtype])


def test_no_tokens(device: torch.device) -> None:
    x = torch.empty(0, 32, device=device)
    w13, w2 = torch.randn(4, 32, 32, device=device), torch.randn(4, 32, 16, device=device)
    ids = torch.empty(0, 2, dtype=torch.int64, device=device)
    assert fused_moe(x, w13, w2, torch.empty(0, 2, device=device), ids).shape == (0, 32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_block_fused_and_reference_agree(dtype: torch.dtype, device: torch.device) -> None:
    blocks = [
        SparseMoeBlock(
            48,
            32,
            num_experts=8,
            top_k=2,
            norm_topk_prob=False,
            fused=fused,
            parallel=SINGLE_PROCESS,
            dtype=dtype,
            device=device,
        )
        for fused in (False, True)
    ]
    for index, (name, param) in enumerate(blocks[0].named_parameters()):
        param.copy_(randn(*param.shape, dtype=dtype, device=device, seed=10 + index))
        blocks[1].get_parameter(name).copy_(param)
    x = randn(9, 48, dtype=dtype, device=device, seed=20)
    torch.testing.assert_close(blocks[1](x), blocks[0](x), **TOLERANCE[dtype])
