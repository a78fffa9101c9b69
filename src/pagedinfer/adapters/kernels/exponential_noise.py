"""The sampler's ``Exp(1)`` noise for a whole batch in one launch (see
:mod:`pagedinfer.adapters.sampling.noise` for the seed rule and its torch twin).

In place on ``noise [n, vocab]`` float32 that holds the engine generator's uniforms: rows with
``seeded[r]`` are overwritten with the counter-based hash of ``(seeds[r], steps[r], v)``, and
every row becomes ``-log(U)``. Program ``(r, b)`` handles ``BLOCK`` tokens of row ``r``; the
hash is computed on int32 words exactly as the twin does (wrapping multiplies, logical shifts
as arithmetic shift plus mask), so the seeded uniforms match it bit for bit. The rule's two
halves (:func:`seed_rule_row_keys`, :func:`seed_rule_uniform`) are ``triton.jit`` functions
that :mod:`~pagedinfer.adapters.kernels.race_sample` shares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.launch import launch

__all__ = ["exponential_noise_", "seed_rule_row_keys", "seed_rule_uniform"]

_BLOCK = 2048


@triton.jit
def _mix(x):  # type: ignore[no-untyped-def]
    # murmur3 fmix32 on int32 words; the literals are 0x85EBCA6B and 0xC2B2AE35 as int32.
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * -2048144789
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * -1028477387
    x = x ^ ((x >> 16) & 0xFFFF)
    return x


@triton.jit
def seed_rule_row_keys(seed_lo, seed_hi, step32):  # type: ignore[no-untyped-def]
    """The rule's ``(k0, k1)`` of one row from its seed's 32-bit halves and its step (int32):
    four Feistel rounds ``(L, R) -> (R, L ^ mix(R ^ mix(step ^ salt)))`` from
    ``(seed_lo, seed_hi)``, one-to-one in the 64-bit seed."""
    # Round salts 0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344 as int32. Round i maps
    # (L, R) = (r[i-1], r[i]) to (r[i], r[i+1]), from (r[-1], r[0]) = (seed_lo, seed_hi).
    r1 = seed_lo ^ _mix(seed_hi ^ _mix(step32 ^ 608135816))
    r2 = seed_hi ^ _mix(r1 ^ _mix(step32 ^ -2052912941))
    r3 = r1 ^ _mix(r2 ^ _mix(step32 ^ 320440878))
    r4 = r2 ^ _mix(r3 ^ _mix(step32 ^ 57701188))
    return r3, r4


@triton.jit
def seed_rule_uniform(offs, k0, k1):  # type: ignore[no-untyped-def]
    """The rule's uniforms in (0, 1) (float32) of token indices ``offs`` of a row keyed
    ``(k0, k1)``: bit for bit :func:`~pagedinfer.adapters.sampling.noise.seeded_uniform_torch`."""
    x = offs.to(tl.int32) * -1640531527  # 0x9E3779B9
    x = _mix(_mix(x ^ k0) + k1)
    return (((x >> 9) & 0x7FFFFF).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit  # type: ignore[untyped-decorator]
def _exponential_noise_kernel(  # type: ignore[no-untyped-def]
    noise_ptr,
    seeds_ptr,
    steps_ptr,
    seeded_ptr,
    vocab,
    stride_row,
    BLOCK: tl.constexpr,
    TAKE_LOG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    ptrs = noise_ptr + row * stride_row + offs
    if tl.load(seeded_ptr + row) != 0:
        seed = tl.load(seeds_ptr + row)
        step = tl.load(steps_ptr + row)
        seed_lo = (seed & 0xFFFFFFFF).to(tl.int32)
        seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.int32)
        step32 = (step & 0xFFFFFFFF).to(tl.int32)
        k0, k1 = seed_rule_row_keys(seed_lo, seed_hi, step32)
        uniform = seed_rule_uniform(offs, k0, k1)
    else:
        uniform = tl.load(ptrs, mask=mask, other=1.0)
    if TAKE_LOG:
        tl.store(ptrs, -tl.log(uniform), mask=mask)
    else:
        tl.store(ptrs, uniform, mask=mask)


def exponential_noise_(
    noise: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    seeded: torch.Tensor,
    *,
    take_log: bool = True,
) -> torch.Tensor:
    """Turn ``noise`` (uniforms) into ``Exp(1)`` noise in place, seeded rows by the rule.

    ``take_log=False`` leaves the uniforms (the seeded rows' hash values; tests compare them
    with the torch twin bit for bit).
    """
    num_rows, vocab = noise.shape
    assert noise.dtype == torch.float32 and noise.stride(1) == 1, (noise.dtype, noise.stride())
    assert seeds.shape == steps.shape == seeded.shape == (num_rows,)
    assert seeds.dtype == steps.dtype == torch.int64, (seeds.dtype, steps.dtype)
    if num_rows == 0 or vocab == 0:
        return noise
    block = min(_BLOCK, triton.next_power_of_2(vocab))
    launch(_exponential_noise_kernel, (num_rows, triton.cdiv(vocab, block)))(
        noise,
        seeds,
        steps,
        seeded,
        vocab,
        noise.stride(0),
        BLOCK=block,
        TAKE_LOG=take_log,
        num_warps=4,
    )
    return noise
