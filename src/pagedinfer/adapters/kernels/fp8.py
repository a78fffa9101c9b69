"""FP8 (e4m3 / e5m2) quantization and dequantization inside Triton kernels, in integer ops.

The KV cache may hold ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (see
:mod:`pagedinfer.adapters.kv_cache`); the store kernels quantize, the attention kernels
dequantize on the fly. Both work on the raw bytes (kernels get ``uint8`` views of the cache)
with integer arithmetic instead of Triton's float8 types, because:

* Triton's interpreter converts float32 to float8 neither saturating nor to nearest even
  (Triton 3.6: 1000.0 -> 256 in e4m3, ties round away from zero), so the interpreted kernels
  could not be checked against torch; its float8 -> float32 conversion is exact, but the same
  code must run on the GPU;
* Triton refuses the e4m3 type (``fp8e4nv``) below sm_89: bytes and integers run everywhere.

The result is the same bytes on every GPU and in the interpreter, equal bit for bit to
:func:`pagedinfer.adapters.kv_cache.quantize_fp8` (torch's ``.to(float8)`` after the clamp),
which the tests check on every rounding boundary.

Formats (``FP8_FORMAT``, a constexpr): ``0`` no FP8 (a cache in the model's dtype), ``1``
e4m3 (exponent bias 7, 3 mantissa bits, largest 448, no infinities), ``2`` e5m2 (bias 15,
2 mantissa bits, largest 57344).

Quantize: ``y = x * inverse_scale`` in float32, ``|y|`` clamped to the largest finite value,
then rounded to nearest even:

* normal range (``|y| >= 2**(1 - bias)``): the float32 bit pattern is rounded at the last
  kept mantissa bit (add ``half - 1`` plus the kept lowest bit, shift right), so a carry moves
  into the exponent as it should; subtracting the difference of the exponent biases leaves
  the float8 byte;
* subnormals: ``|y| * 2**(bias + mantissa - 1)`` is the byte itself, an integer in
  ``[0, 2**mantissa]`` after rounding, which is done with an exact float32 comparison.

Dequantize: e5m2 is the upper byte of a float16 (``byte << 8``). e4m3's sign, exponent and
mantissa moved into float16's places (``sign << 8 | rest << 7``) read as ``value * 2**-8``,
normals and subnormals alike; the kernels fold the ``2**8`` into the scale
(:data:`DEQUANT_FACTOR`). Both are exact and need no conversion instruction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.adapters.kv_cache import is_fp8

__all__ = [
    "DEQUANT_FACTOR",
    "FP8_E4M3",
    "FP8_E5M2",
    "NO_FP8",
    "cache_bytes",
    "dequantize_fp8",
    "fp8_format",
    "quantize_fp8",
]

NO_FP8 = 0
FP8_E4M3 = 1
FP8_E5M2 = 2

DEQUANT_FACTOR: dict[int, float] = {NO_FP8: 1.0, FP8_E4M3: 256.0, FP8_E5M2: 1.0}
"""What :func:`dequantize_fp8`'s float16 values must be multiplied by (with the scale)."""


def fp8_format(dtype: torch.dtype) -> int:
    """The ``FP8_FORMAT`` constexpr for a cache dtype."""
    if dtype == torch.float8_e4m3fn:
        return FP8_E4M3
    if dtype == torch.float8_e5m2:
        return FP8_E5M2
    assert not is_fp8(dtype), dtype
    return NO_FP8


def cache_bytes(cache: torch.Tensor) -> torch.Tensor:
    """What a kernel is given for ``cache``: its bytes when FP8 (no copy), else the cache."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


@triton.jit  # type: ignore[untyped-decorator]
def _round_to_fp8(  # type: ignore[no-untyped-def]
    y,  # float32
    DROP: tl.constexpr,  # float32 mantissa bits below the format's: 23 - mantissa bits
    EXPONENT_OFFSET: tl.constexpr,  # (127 - bias) << mantissa bits
    LARGEST: tl.constexpr,  # the largest finite value
    MIN_NORMAL: tl.constexpr,  # 2 ** (1 - bias)
    SUBNORMAL_SCALE: tl.constexpr,  # 2 ** (bias + mantissa bits - 1): one subnormal step
):
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = tl.minimum(tl.abs(y), LARGEST)
    magnitude_bits = magnitude.to(tl.int32, bitcast=True)
    half_minus_one = (1 << (DROP - 1)) - 1
    kept = (magnitude_bits + half_minus_one + ((magnitude_bits >> DROP) & 1)) >> DROP
    normal = kept - EXPONENT_OFFSET
    steps = tl.minimum(magnitude, MIN_NORMAL) * SUBNORMAL_SCALE  # exact: a power of two
    whole = steps.to(tl.int32)  # truncation
    fraction = steps - whole.to(tl.float32)
    up = (fraction > 0.5) | ((fraction == 0.5) & ((whole & 1) == 1))
    subnormal = whole + up.to(tl.int32)
    byte = tl.where(magnitude < MIN_NORMAL, subnormal, normal) | sign
    return byte.to(tl.uint8)


@triton.jit  # type: ignore[untyped-decorator]
def quantize_fp8(x, inverse_scale, FP8_FORMAT: tl.constexpr):  # type: ignore[no-untyped-def]
    """``x * inverse_scale`` as float8 bytes (``uint8``): saturating, round to nearest even."""
    y = x.to(tl.float32) * inverse_scale
    if FP8_FORMAT == 1:
        byte = _round_to_fp8(y, 20, 960, 448.0, 0.015625, 512.0)
    else:
        byte = _round_to_fp8(y, 21, 448, 57344.0, 0.00006103515625, 65536.0)
    return byte


@triton.jit  # type: ignore[untyped-decorator]
def dequantize_fp8(byte, FP8_FORMAT: tl.constexpr):  # type: ignore[no-untyped-def]
    """float8 bytes -> float16: the value for e5m2, ``value * 2**-8`` for e4m3 (exact)."""
    wide = byte.to(tl.int32)
    if FP8_FORMAT == 1:  # noqa: SIM108 - a constexpr branch, resolved at compile time
        half = ((wide & 0x80) << 8) | ((wide & 0x7F) << 7)
    else:
        half = wide << 8
    return half.to(tl.uint16).to(tl.float16, bitcast=True)
