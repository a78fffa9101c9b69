"""The split-K launch shared by the GEMMs (``fp8_gemm``, ``int4_gemm``, ``skinny_gemm``).

A decode step has few rows, so ``[M, N]`` makes too few output tiles to fill the GPU; the K
range of each tile is then split among several programs, each writing its partial sum into its
own float32 slice of ``out [splits, M, N]``, and :func:`sum_splits` adds them up. One split
writes the result in ``x``'s dtype directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from pagedinfer.adapters.kernels.target import kernel_target

__all__ = ["TILE_N", "SplitKLaunch", "plan_split_k", "row_tile", "sum_splits"]

TILE_N = 64


def row_tile(m: int) -> int:
    """The tile's rows for ``m`` rows: 16, 32 or 64 (the smallest that holds them, at most 64)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _split_count(device: torch.device, tiles: int, k_steps: int) -> int:
    """How many programs share one output tile's K range: enough programs for two per SM
    (decode, few rows), at most 8 and never more than there are K steps."""
    target = kernel_target(device)
    if target is None or k_steps <= 1:
        return 1
    wanted = 2 * target.num_sms
    return max(1, min(8, k_steps, -(-wanted // tiles)))


@dataclass(frozen=True)
class SplitKLaunch:
    """Tile sizes, the K range per program, the partial-sum buffer and the grid."""

    block_m: int
    block_n: int
    splits: int
    k_per_split: int
    out: torch.Tensor  # [splits, M, N]: float32 when split, else x's dtype
    grid: tuple[int, int, int]


def plan_split_k(
    x: torch.Tensor, m: int, n: int, k: int, block_k: int, split_k: int | None
) -> SplitKLaunch:
    """The launch for ``m`` rows of ``x`` against an ``[N, K]`` weight walked ``block_k`` at a
    time; ``split_k`` overrides the split (tests), else it is chosen from the shape and GPU."""
    block_m = row_tile(m)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, TILE_N)
    k_steps = triton.cdiv(k, block_k)
    splits = split_k if split_k is not None else _split_count(x.device, tiles, k_steps)
    k_per_split = triton.cdiv(k_steps, splits) * block_k
    splits = triton.cdiv(k, k_per_split)  # no empty split at the end
    out_dtype = torch.float32 if splits > 1 else x.dtype
    out = torch.empty((splits, m, n), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, TILE_N), splits)
    return SplitKLaunch(block_m, TILE_N, splits, k_per_split, out, grid)


def sum_splits(launch: SplitKLaunch, x: torch.Tensor, n: int) -> torch.Tensor:
    """The result ``[..., N]`` in ``x``'s dtype from the programs' partial sums."""
    out = launch.out
    result = out[0] if launch.splits == 1 else out.sum(dim=0).to(x.dtype)
    return result.view(*x.shape[:-1], n)
