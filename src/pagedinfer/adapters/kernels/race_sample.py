"""The sampler's common path in two launches: temperature, noise and exponential race fused.

The race ``argmax_v p_v / E_v`` with ``p = softmax(logits / T)`` and ``E_v = -log U_v`` picks
the same token as ``argmax_v (logits_v / T - log E_v)`` (the log is monotonic and the softmax's
normaliser is the same for every ``v``), i.e. Gumbel-max. The kernel ranks the same keys in
base 2, ``logits_v * log2(e) / T - log2(-log2 U_v)`` (``log2(e)`` times the key above, minus
the constant ``log2(log2(e))``): the same argmax, with a multiply instead of a division and
the GPU's fast ``log2``, since the integer hash and the logs, not the memory, bound this
kernel. In that form a row needs one pass
over its logits, read in their own dtype and computed in float32; neither the probabilities
nor the noise are ever stored. Rows whose temperature is below ``greedy_epsilon`` (the table
stores greedy rows as 0.0) take ``argmax_v logits_v``. Ties go to the lowest token index, as
``torch.argmax``'s do; a NaN key never wins (``torch.argmax`` would return a NaN's index).

Noise: every row's ``U`` comes from the seed rule of
:mod:`pagedinfer.adapters.sampling.noise` (the same ``triton.jit`` halves as
:mod:`~pagedinfer.adapters.kernels.exponential_noise`):

* a **seeded** row (``seeds[r] != NO_SEED``) is keyed by ``(seeds[r], steps[r])`` as always,
  so its ``E`` is the very number the unfused sampler divides by; the tokens are the same up
  to float near-ties between the ratio and the log form (a different rounding of two keys
  that agree to within a few float32 ulps);
* an **unseeded** row is keyed by ``(step_key, r)``: ``step_key`` is one 63-bit value the
  sampler draws on the host per step (from its own ``random.Random(engine seed)``, no device
  read) and ``r`` the row's index in the batch. The rule's row key is one-to-one in all 64
  bits of its seed at each step, so row ``r`` of two steps shares noise only if their step
  keys are equal (about ``2**-63`` per pair of steps), and two rows of one step only by a
  chance of about ``2**-64``. The unfused path draws these rows' uniforms from the engine's
  ``torch.Generator`` instead: both are reproducible for a given engine seed and order of
  steps, and neither makes an unseeded request's tokens independent of its batch.

Tiling: program ``(r, c)`` scans chunk ``c`` of row ``r`` (``chunk_len`` tokens, a multiple of
``BLOCK``) tile by tile, keeping per lane the best key and the first index that reached it,
and writes the chunk's best key and its lowest index to ``[rows, chunks]`` partials; a second
kernel, one program per row, reduces the chunks the same way. The number of chunks depends on
the vocabulary only (about ``_TARGET_CHUNKS``, so 256 rows fill an H100's 132 SMs several
times over); the row count is the grid's, the step key travels as two int32 words, and neither
they nor the parameter columns' strides and alignments are specialised on, so a run compiles
each kernel once.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kernels.exponential_noise import seed_rule_row_keys, seed_rule_uniform
from pagedinfer.adapters.kernels.launch import launch
from pagedinfer.adapters.sampling.batch import NO_SEED

__all__ = ["race_sample"]

_BLOCK = 1024
_TARGET_CHUNKS = 16
_MASK32 = 0xFFFFFFFF
_INT32_MAX = 2**31 - 1


@triton.jit  # type: ignore[untyped-decorator]
def _chunk_best(  # type: ignore[no-untyped-def]
    row_ptr, start, end, scale, k0, k1, BLOCK: tl.constexpr, SAMPLE: tl.constexpr
):
    # Per lane: the best key so far and the first index that reached it (strict ">" keeps
    # the earlier tile on a tie); across lanes, the lowest index among the best keys.
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = start + tl.arange(0, BLOCK)
    for tile in range(start, end, BLOCK):
        offs = tile + tl.arange(0, BLOCK)
        mask = offs < end
        key = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if SAMPLE:
            # In base 2 (see the module docstring): a multiply and two log2s per token.
            uniform = seed_rule_uniform(offs, k0, k1)
            key = key * scale - tl.log2(-tl.log2(uniform))
        better = key > best
        best = tl.where(better, key, best)
        best_index = tl.where(better, offs, best_index)
    top = tl.max(best, 0)
    return top, tl.min(tl.where(best == top, best_index, 2147483647), 0)


_UNSPECIALIZED = ["stride_temperature", "stride_seed", "stride_step", "key_lo", "key_hi"]
# Scalar loads: a column of the sampling table (offset) and a fresh tensor, or the seeds
# standing in for absent steps, must not compile two variants. Triton versions without
# ``do_not_specialize_on_alignment`` (it is not in every 3.x) get the broader
# ``do_not_specialize`` for these pointers, which drops the alignment key too.
_UNALIGNED = ["temperatures_ptr", "seeds_ptr", "steps_ptr"]
if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
    _CHUNKS_JIT_OPTIONS: dict[str, list[str]] = {
        "do_not_specialize": _UNSPECIALIZED,
        "do_not_specialize_on_alignment": _UNALIGNED,
    }
else:  # pragma: no cover - older Triton
    _CHUNKS_JIT_OPTIONS = {"do_not_specialize": _UNSPECIALIZED + _UNALIGNED}


@triton.jit(**_CHUNKS_JIT_OPTIONS)  # type: ignore[untyped-decorator]
def _race_chunks_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,
    temperatures_ptr,
    seeds_ptr,
    steps_ptr,
    keys_ptr,
    indices_ptr,
    vocab,
    stride_row,
    stride_temperature,
    stride_seed,
    stride_step,
    key_lo,
    key_hi,
    greedy_epsilon,
    chunk_len,
    NUM_CHUNKS: tl.constexpr,
    NO_SEED_VALUE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    start = chunk * chunk_len
    end = tl.minimum(start + chunk_len, vocab)
    row_ptr = logits_ptr + row * stride_row
    temperature = tl.load(temperatures_ptr + row * stride_temperature)
    if temperature < greedy_epsilon:
        top, index = _chunk_best(row_ptr, start, end, 1.0, 0, 0, BLOCK, False)
    else:
        seed = tl.load(seeds_ptr + row * stride_seed)
        step = tl.load(steps_ptr + row * stride_step)
        unseeded = seed == NO_SEED_VALUE
        seed_lo = tl.where(unseeded, key_lo, (seed & 0xFFFFFFFF).to(tl.int32))
        seed_hi = tl.where(unseeded, key_hi, ((seed >> 32) & 0xFFFFFFFF).to(tl.int32))
        step32 = tl.where(unseeded, row.to(tl.int32), (step & 0xFFFFFFFF).to(tl.int32))
        k0, k1 = seed_rule_row_keys(seed_lo, seed_hi, step32)
        scale = 1.4426950408889634 / temperature  # log2(e) / T
        top, index = _chunk_best(row_ptr, start, end, scale, k0, k1, BLOCK, True)
    tl.store(keys_ptr + row * NUM_CHUNKS + chunk, top)
    tl.store(indices_ptr + row * NUM_CHUNKS + chunk, index)


@triton.jit  # type: ignore[untyped-decorator]
def _race_finish_kernel(  # type: ignore[no-untyped-def]
    keys_ptr, indices_ptr, out_ptr, NUM_CHUNKS: tl.constexpr, CHUNKS_POW2: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS_POW2)
    mask = offs < NUM_CHUNKS
    keys = tl.load(keys_ptr + row * NUM_CHUNKS + offs, mask=mask, other=float("-inf"))
    indices = tl.load(indices_ptr + row * NUM_CHUNKS + offs, mask=mask, other=2147483647)
    top = tl.max(keys, 0)
    token = tl.min(tl.where(keys == top, indices, 2147483647), 0)
    tl.store(out_ptr + row, token.to(tl.int64))


def _signed32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def race_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor | None,
    *,
    step_key: int,
    greedy_epsilon: float,
) -> torch.Tensor:
    """One token id per row of ``logits [n, vocab]`` (int64 ``[n]``), in two launches.

    ``temperatures [n]`` float32 (below ``greedy_epsilon``: greedy), ``seeds [n]`` int64
    (``NO_SEED``: unseeded), ``steps [n]`` int64 the seeded rows' sample steps (``None`` when
    no row is seeded), ``step_key`` in ``[0, 2**63)`` keys the unseeded rows' noise. The
    parameter tensors may be strided views (columns of the sampling table).
    """
    num_rows, vocab = logits.shape
    assert logits.stride(1) == 1, logits.stride()
    assert temperatures.shape == seeds.shape == (num_rows,), (temperatures.shape, seeds.shape)
    assert temperatures.dtype == torch.float32 and seeds.dtype == torch.int64
    assert 0 <= step_key < 1 << 63, step_key
    assert 0 < vocab <= _INT32_MAX, vocab
    if steps is None:
        steps = seeds  # read, never used: no row is seeded
    assert steps.shape == (num_rows,) and steps.dtype == torch.int64, (steps.shape, steps.dtype)
    out = torch.empty((num_rows,), dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(vocab))
    tiles = triton.cdiv(vocab, block)
    chunk_len = triton.cdiv(tiles, _TARGET_CHUNKS) * block
    num_chunks = triton.cdiv(vocab, chunk_len)
    keys = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=logits.device)
    indices = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=logits.device)
    launch(_race_chunks_kernel, (num_rows, num_chunks))(
        logits,
        temperatures,
        seeds,
        steps,
        keys,
        indices,
        vocab,
        logits.stride(0),
        temperatures.stride(0),
        seeds.stride(0),
        steps.stride(0),
        _signed32(step_key & _MASK32),
        _signed32(step_key >> 32),
        greedy_epsilon,
        chunk_len,
        NUM_CHUNKS=num_chunks,
        NO_SEED_VALUE=NO_SEED,
        BLOCK=block,
        num_warps=4,
    )
    launch(_race_finish_kernel, (num_rows,))(
        keys,
        indices,
        out,
        NUM_CHUNKS=num_chunks,
        CHUNKS_POW2=triton.next_power_of_2(num_chunks),
        num_warps=1,
    )
    return out
