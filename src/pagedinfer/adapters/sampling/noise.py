"""The sampler's noise: ``Exp(1)`` per (row, token), seeded rows from a counter-based hash.

The sampler draws ``argmax_v p_v / E_v`` (the exponential race), so all of its randomness is
the noise tensor ``E [n, vocab]``. Two sources:

* **Unseeded rows** take ``E = -log(U)`` with ``U`` from the engine's generator (one
  ``uniform_`` over the batch): fast everywhere, and reproducible for a given engine seed and
  request order. (The fused CUDA path, :mod:`pagedinfer.adapters.kernels.race_sample`, keys
  them by the rule below instead, with a per-step key from the sampler as the seed and the
  row index as the step.)
* **Seeded rows** take ``U`` from a counter-based hash of ``(seed, sample_step, token index)``,
  so a request's draws never depend on what else is in the batch, on the batch's order, or
  on preemption (``sample_step`` counts the request's completion tokens, which a recomputed
  request reaches again with the same value). No generator object per row: the whole batch's
  seeded noise is one vectorised pass (one Triton kernel on CUDA, which also turns the
  unseeded rows' ``U`` into ``E``, so the noise costs two launches however many rows are
  seeded).

The seed rule, exactly (all arithmetic on 32-bit words, wrapping; ``>>`` is a logical shift)::

    mix(x)    = murmur3's fmix32: x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13;
                                  x *= 0xC2B2AE35; x ^= x >> 16
    SALT      = 0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344     (pi's first fraction words)
    (L, R)    = (seed_lo, seed_hi)                          seed = seed_hi * 2**32 + seed_lo
    for i in 0, 1, 2, 3:                                    four Feistel rounds
        (L, R) = (R, L ^ mix(R ^ mix(step ^ SALT[i])))
    (k0, k1)  = (L, R)
    h(v)      = mix(mix((v * 0x9E3779B9) ^ k0) + k1)          v = token index
    U(v)      = ((h(v) >> 9) + 0.5) / 2**23                   in (0, 1): E = -log U is finite

``seed`` is a request's ``SamplingParams.seed`` (0 <= seed < 2**63) and ``step`` its sample
step (the number of completion tokens before this one; its low 32 bits enter, and steps stay
far below 2**32). Each Feistel round is a bijection of the 64-bit word ``(L, R)`` whatever its
round function, so for every step the row key ``(k0, k1)`` is a one-to-one function of all 64
bits of the seed: two distinct seeds never share a row key at the same step (an earlier rule
folded the seed into 32 bits first, so seeds such as 12345 and 8,122,140,338 drew identical
noise). The step enters every round, so ``(seed, step)`` pairs of different steps collide only
by chance (about 2**-64 per pair), and a row key determines the row's whole noise vector.
Changing this rule changes every seeded request's output: treat it as part of the public
contract.

The torch twin here (:func:`seeded_uniform_torch`) computes the same bits on int32 tensors
(wrapping multiplies, logical shifts as arithmetic shift plus mask), in row chunks that stay in
cache; the kernel (:mod:`pagedinfer.adapters.kernels.exponential_noise`) is tested against it
bit for bit.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["exponential_noise", "row_keys", "seeded_uniform_torch", "signed32"]

# The rule's constants as the signed 32-bit words torch and Triton compute with.
_MASK32 = 0xFFFFFFFF


def signed32(value: int) -> int:
    """The 32-bit word ``value & 0xFFFFFFFF`` as a signed int (how int32 tensors hold it)."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


MIX_C1 = signed32(0x85EBCA6B)
MIX_C2 = signed32(0xC2B2AE35)
GOLDEN = signed32(0x9E3779B9)
# The Feistel rounds' salts (the first words of pi's fraction), one per round.
ROUND_SALTS = tuple(signed32(salt) for salt in (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344))
# Hash bits a uniform keeps: k + 0.5 for k < 2**23 fits float32's 24-bit significand, so
# every uniform is exact (and never 0 or 1).
UNIFORM_BITS = 23

# Elements per chunk of the CPU twin: the int32 temporaries of a chunk stay in cache.
_CHUNK_ELEMENTS = 1 << 16


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32 in place on int32 words (logical shifts: arithmetic shift, then mask)."""
    x ^= (x >> 16) & 0xFFFF
    x.mul_(MIX_C1)
    x ^= (x >> 13) & 0x7FFFF
    x.mul_(MIX_C2)
    x ^= (x >> 16) & 0xFFFF
    return x


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k0, k1)`` int32 ``[n]`` of the rule from int64 seeds and steps: four Feistel rounds
    over the seed's two 32-bit halves, keyed by the step (one-to-one in the seed)."""
    left = _as_int32(seeds & _MASK32)
    right = _as_int32((seeds >> 32) & _MASK32)
    step = _as_int32(steps & _MASK32)
    for salt in ROUND_SALTS:
        left, right = right, left ^ _mix_(right ^ _mix_(step ^ salt))
    return left, right


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> the int32 tensor with the same low 32 bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@functools.lru_cache(maxsize=8)
def _scrambled_indices(vocab: int, device: torch.device) -> torch.Tensor:
    """``v * 0x9E3779B9`` (wrapping) for every token index, as int32 ``[vocab]``."""
    # Built on the device: no host-to-device copy (it may first run inside a step's launch).
    indices = torch.arange(vocab, dtype=torch.int64, device=device) * (GOLDEN & _MASK32)
    return _as_int32(indices & _MASK32)


def seeded_uniform_torch(
    seeds: torch.Tensor, steps: torch.Tensor, vocab: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``U [n, vocab]`` float32 of the seed rule for rows ``(seeds[i], steps[i])`` (int64)."""
    num_rows = int(seeds.shape[0])
    if out is None:
        out = torch.empty((num_rows, vocab), dtype=torch.float32, device=seeds.device)
    if num_rows == 0:
        return out
    k0, k1 = row_keys(seeds, steps)
    scrambled = _scrambled_indices(vocab, seeds.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, num_rows, chunk):
        end = min(num_rows, start + chunk)
        x = scrambled ^ k0[start:end, None]
        _mix_(x)
        x += k1[start:end, None]
        _mix_(x)
        x = (x >> (32 - UNIFORM_BITS)) & ((1 << UNIFORM_BITS) - 1)
        out[start:end].copy_(x).add_(0.5).mul_(2.0**-UNIFORM_BITS)
    return out


def exponential_noise(
    shape: tuple[int, int],
    *,
    generator: torch.Generator,
    seeds: torch.Tensor | None = None,
    steps: torch.Tensor | None = None,
    seeded: torch.Tensor | None = None,
) -> torch.Tensor:
    """``E [n, vocab]`` float32: unseeded rows from ``generator``, seeded rows by the rule.

    ``seeds`` / ``steps`` (int64 ``[n]``) and ``seeded`` (bool ``[n]``) describe the rows;
    leave them out when no row is seeded (the common case: one ``uniform_`` and a log).
    """
    device = generator.device
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    noise.uniform_(generator=generator)
    if seeded is None:
        return noise.log_().neg_()
    assert seeds is not None and steps is not None
    if device.type == "cuda":
        from pagedinfer.adapters.kernels.exponential_noise import exponential_noise_

        return exponential_noise_(noise, seeds, steps, seeded)
    rows = seeded.nonzero().flatten()  # no device sync on the CPU
    if rows.numel():
        noise[rows] = seeded_uniform_torch(seeds[rows], steps[rows], shape[1])
    return noise.log_().neg_()
