"""The batched LoRA kernels (Punica's BGMV shrink/expand) against their torch twins: tokens of
several adapters and of the base model (slot -1) in one launch, ranks and widths that are not
multiples of the tiles, packed projections (a column slice of the output), float32 and
float16."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.adapters.kernels.lora import lora_expand_triton, lora_shrink_triton
from pagedinfer.adapters.lora.ops import lora_expand, lora_shrink, slot_mask

DTYPES = [torch.float32, torch.float16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_slots", "rank", "in_features", "out_features"),
    [(1, 1, 8, 64, 48), (7, 3, 16, 200, 130), (12, 4, 5, 96, 257)],
)
def test_shrink_and_expand_match_the_twins(
    device: torch.device,
    dtype: torch.dtype,
    num_tokens: int,
    num_slots: int,
    rank: int,
    in_features: int,
    out_features: int,
) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 31 + rank)
    x = torch.randn(num_tokens, in_features, generator=gen).to(device, dtype)
    a = (torch.randn(num_slots, rank, in_features, generator=gen) / 8).to(device, dtype)
    b = (torch.randn(num_slots, rank, out_features, generator=gen) / 4).to(device, dtype)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen).to(device)
    slots[0] = -1  # a base token always
    mask = slot_mask(slots, num_slots, torch.float32)

    s = lora_shrink_triton(x, a, slots)
    want_s = lora_shrink(x.float(), a.float(), mask)
    torch.testing.assert_close(s.float(), want_s, **_tol(dtype))
    assert not s[0].any()  # the base token's rank vector is zero

    # Expand into a column slice of a wider (packed) output, as the projections do.
    out = torch.randn(num_tokens, out_features + 10, generator=gen).to(device, dtype)
    before = out.clone()
    lora_expand_triton(out[:, 3 : 3 + out_features], s, b, slots)
    want = before.float()
    lora_expand(want[:, 3 : 3 + out_features], s.float(), b.float(), mask)
    torch.testing.assert_close(out.float(), want, **_tol(dtype))
    assert torch.equal(out[0], before[0])  # nothing added to the base token
    assert torch.equal(out[:, :3], before[:, :3]) and torch.equal(
        out[:, 3 + out_features :], before[:, 3 + out_features :]
    )


def test_a_packed_shrink_feeds_each_part(device: torch.device) -> None:
    """One shrink over stacked parts (q, k, v), then each part's expand from its columns."""
    gen = torch.Generator().manual_seed(5)
    rank, parts = 4, 3
    x = torch.randn(5, 32, generator=gen).to(device)
    a = torch.randn(2, parts * rank, 32, generator=gen).to(device)
    bs = [torch.randn(2, rank, 16, generator=gen).to(device) for _ in range(parts)]
    slots = torch.tensor([0, 1, -1, 1, 0], device=device)
    mask = slot_mask(slots, 2, torch.float32)
    s = lora_shrink_triton(x, a, slots)
    out = torch.zeros(5, 16 * parts, device=device)
    want = out.clone()
    for index, b in enumerate(bs):
        columns = slice(index * 16, (index + 1) * 16)
        lora_expand_triton(out[:, columns], s[:, index * rank : (index + 1) * rank], b, slots)
        own = lora_shrink(x, a[:, index * rank : (index + 1) * rank], mask)
        lora_expand(want[:, columns], own, b, mask)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
