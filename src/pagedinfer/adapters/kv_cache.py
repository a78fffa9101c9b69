"""The paged KV cache: its one tensor, its element type, and how many blocks fit in memory.

Layout: ``[2, num_layers, num_blocks, block_size, num_kv_heads_per_rank, head_dim]``; index 0
holds keys, 1 values, and attention layer ``i`` works on the views ``cache[0, i]`` and
``cache[1, i]``. The sizing rules are pure functions of plain numbers so they can be tested
without the memory they describe.

**Element type** (``kv_cache_dtype``, vLLM's names): ``"auto"`` is the model's dtype;
``"fp8"`` / ``"fp8_e4m3"`` store ``torch.float8_e4m3fn`` and ``"fp8_e5m2"`` stores
``torch.float8_e5m2``: one byte per element, so the same memory holds twice the blocks of a
16-bit cache (four times a float32 one).

**FP8 scales**, one per layer for K and one for V: a value ``x`` is stored as
``fp8(clamp(x / scale, -max, max))`` (saturating, round-to-nearest-even; ``max`` is 448 for
e4m3, 57344 for e5m2) and read back as ``stored * scale``. Each layer's scales live in a
float32 tensor of :data:`NUM_SCALE_FIELDS` elements, ``[k_scale, v_scale, 1 / k_scale,
1 / v_scale]`` (:func:`scale_row`); the model runner keeps one ``[num_layers, 4]`` tensor
and binds row ``i`` to attention layer ``i`` beside its cache views, and every backend and
store kernel takes that row as ``kv_scales``. Kernels read the scales on the device, so the
values may change without recapturing CUDA graphs.

Where the scales come from (decided by the model runner at start-up, per layer):

1. **the checkpoint**: a checkpoint that carries per-layer ``k_scale`` / ``v_scale`` tensors
   (vLLM's convention: ``stored = x / k_scale``; e.g. ``model.layers.N.self_attn.k_scale``,
   or ``...k_proj.k_scale`` / ``...attn.k_scale`` in older exports) hands them over with
   **the hook** :meth:`pagedinfer.adapters.layers.attention.PagedAttention.set_kv_scales`
   (``model.attention_layers()[N].set_kv_scales(k_scale=..., v_scale=...)``, either may be
   given alone; a float or a one-element tensor, finite and > 0). The weight loader calls it
   while loading; the runner reads what was set once the weights are in. With
   ``kv_cache_dtype="auto"`` they are ignored (as vLLM does).
2. otherwise **calibrated**: before the cache is sized, the runner prefills a fixed
   pseudo-random prompt (:data:`CALIBRATION_TOKENS` tokens) into a temporary cache in the
   model's dtype, takes each layer's largest ``|K|`` and ``|V|`` (the maximum over
   tensor-parallel ranks, so every rank agrees) and picks :func:`calibrated_scale`: the power
   of two that maps that maximum into ``(max / 4, max / 2]``, leaving 2-4x headroom for
   inputs larger than the calibration prompt's before saturating, while small values keep
   their relative precision (e4m3 is a float: its precision does not depend on the scale
   until values fall below ``2**-6 * scale``). Powers of two make ``x / scale`` exact.

vLLM's default is scale 1.0 unless ``calculate_kv_scales`` (which computes scales from the
first batch it serves). 1.0 saturates a layer whose ``|K|`` passes 448 and flushes small
values (``|V|`` below ``2**-6``, common in real models) into e4m3's coarse subnormals; the
first real batch is an accident of traffic. Calibration at start-up avoids both and is
deterministic. See docs/models.md for the measured accuracy.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from pagedinfer.errors import ConfigurationError, KVCacheMemoryError

__all__ = [
    "CALIBRATION_TOKENS",
    "CPU_KV_CACHE_MEMORY_FRACTION",
    "CPU_KV_CACHE_WEIGHTS_MULTIPLE",
    "FP8_DTYPES",
    "KV_CACHE_DTYPES",
    "NUM_SCALE_FIELDS",
    "allocate_kv_cache",
    "available_host_memory",
    "blocks_for_memory",
    "calibrated_scale",
    "cpu_kv_block_budget",
    "cuda_kv_block_budget",
    "dequantize_fp8",
    "fp8_max",
    "is_fp8",
    "kv_block_bytes",
    "kv_cache_dtype_name",
    "max_useful_blocks",
    "quantize_fp8",
    "resolve_kv_cache_dtype",
    "scale_row",
    "unit_scales",
]

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""``kv_cache_dtype`` values (vLLM's names; ``"fp8"`` is e4m3, as in vLLM)."""

_FP8_BY_NAME: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)

NUM_SCALE_FIELDS = 4
"""Elements of one layer's scale row: ``[k_scale, v_scale, 1 / k_scale, 1 / v_scale]``."""

CALIBRATION_TOKENS = 512
"""Length of the prompt that calibrates FP8 scales (capped by the step budget and
``max_model_len``)."""

# Calibrated scales map a layer's largest |K| (|V|) to at most this fraction of the format's
# largest finite value (and more than half of it): 2-4x headroom before saturation.
_CALIBRATION_HEADROOM = 2.0


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: the model's for ``"auto"``, float8 for the fp8 names.

    Raises :class:`ConfigurationError` for any other name.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    fp8 = _FP8_BY_NAME.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    if fp8 is None:
        raise ConfigurationError(
            f"kv_cache_dtype={kv_cache_dtype!r} is unknown: choose one of "
            f"{', '.join(repr(name) for name in KV_CACHE_DTYPES)} ('fp8' is e4m3)."
        )
    return fp8


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"`` (for logs and the start-up line)."""
    return str(dtype).removeprefix("torch.")


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the float8 cache dtypes (stored quantized, with scales)."""
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of a float8 dtype (448 for e4m3, 57344 for e5m2)."""
    assert is_fp8(dtype), dtype
    return float(torch.finfo(dtype).max)


def scale_row(k_scale: float, v_scale: float) -> list[float]:
    """One layer's scale row, ``[k_scale, v_scale, 1 / k_scale, 1 / v_scale]``, in float32.

    The reciprocals are rounded to float32 here, once, so the Triton store kernels and the
    torch store multiply by the very same number (bit-identical quantization).
    """
    k32, v32 = _float32(k_scale), _float32(v_scale)
    return [k32, v32, _float32(1.0 / k32), _float32(1.0 / v32)]


def unit_scales(device: torch.device | str = "cpu") -> torch.Tensor:
    """A scale row of 1.0 (no scaling): vLLM's default scales."""
    return torch.tensor(scale_row(1.0, 1.0), dtype=torch.float32, device=device)


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def calibrated_scale(amax: float, dtype: torch.dtype) -> float:
    """The power of two that maps ``amax`` (a layer's largest ``|K|`` or ``|V|``) into
    ``(max / 4, max / 2]`` of the float8 format; 1.0 when ``amax`` is 0 or not finite."""
    if not math.isfinite(amax) or amax <= 0.0:
        return 1.0
    target = fp8_max(dtype) / _CALIBRATION_HEADROOM
    return float(2.0 ** math.ceil(math.log2(amax / target)))


def quantize_fp8(x: torch.Tensor, inverse_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in float8 (``inverse_scale`` = ``1 / scale``, a float32 scalar tensor):
    multiplied in float32, clamped to the format's finite range (saturating: e5m2 would round
    large values to inf), rounded to nearest even. The reference the store kernels match bit
    for bit."""
    limit = fp8_max(dtype)
    return (x.to(torch.float32) * inverse_scale).clamp_(-limit, limit).to(dtype)


def dequantize_fp8(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``stored * scale`` (float8 -> float32 is exact), in ``dtype``."""
    return (stored.to(torch.float32) * scale).to(dtype)


# Share of the currently available host RAM the CPU KV cache may take when neither
# num_kv_blocks nor kv_cache_memory_bytes is given. The rest stays for the weights,
# activations, the tokenizer and the user's process.
CPU_KV_CACHE_MEMORY_FRACTION = 0.25
# The default CPU KV cache holds at most this many times the model's weight bytes (but at
# least one max_model_len sequence): a tiny model gets a tiny cache, not a quarter of the RAM.
CPU_KV_CACHE_WEIGHTS_MULTIPLE = 4


def kv_block_bytes(
    *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one block across all layers, keys and values (``num_kv_heads`` per rank), for
    the cache's element type (one byte for float8)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def max_useful_blocks(*, max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """More blocks than this can never be in use at once."""
    return max_num_seqs * (-(-max_model_len // block_size))


def cuda_kv_block_budget(
    *,
    total: int,
    used: int,
    peak: int,
    current: int,
    utilization: float,
    block_bytes: int,
) -> int:
    """Blocks that fit in ``total * utilization`` after a warm-up pass (all numbers in bytes).

    ``used`` is what the device reports in use (this process's reserved memory, other
    processes, the CUDA context); ``peak - current`` is the activation memory the warm-up
    needed on top of what is allocated now, which must stay free for real steps. This is
    nano-vLLM's budget: ``total * utilization - used - peak + current``.
    Raises :class:`KVCacheMemoryError` with the numbers when not even one block fits.
    """
    budget = int(total * utilization) - used - peak + current
    num_blocks = max(budget, 0) // block_bytes
    if num_blocks < 1:
        gib = 1 << 30
        raise KVCacheMemoryError(
            f"no GPU memory left for the KV cache: {total / gib:.2f} GiB total x "
            f"gpu_memory_utilization {utilization} = {total * utilization / gib:.2f} GiB budget, "
            f"{used / gib:.2f} GiB already used, {(peak - current) / gib:.2f} GiB activation peak "
            f"-> {budget / gib:.2f} GiB left, one block needs {block_bytes / gib:.4f} GiB. "
            "Raise gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, or use "
            "a smaller kv_block_size."
        )
    return num_blocks


def cpu_kv_block_budget(
    *,
    available: int,
    block_bytes: int,
    max_blocks: int,
    min_blocks: int = 1,
    weight_bytes: int | None = None,
    fraction: float = CPU_KV_CACHE_MEMORY_FRACTION,
    weights_multiple: int = CPU_KV_CACHE_WEIGHTS_MULTIPLE,
) -> int:
    """Blocks of the CPU KV cache when neither a block count nor a byte size is given.

    What the configuration can use (``max_blocks``), at most ``weights_multiple`` times the
    model's weights (``weight_bytes``; a cache far larger than the model is rarely worth its
    memory on a CPU), but at least ``min_blocks`` (one ``max_model_len`` sequence); never more
    than ``fraction`` of the ``available`` host bytes. Raises :class:`KVCacheMemoryError` with
    the numbers when not even one block fits.
    """
    wanted = max_blocks
    if weight_bytes is not None:
        wanted = min(wanted, max(min_blocks, weights_multiple * weight_bytes // block_bytes))
    num_blocks = min(int(available * fraction) // block_bytes, wanted)
    if num_blocks < 1:
        mib = 1 << 20
        raise KVCacheMemoryError(
            f"no host memory left for the KV cache: {available / mib:.1f} MiB available x "
            f"{fraction} = {available * fraction / mib:.1f} MiB budget, one block needs "
            f"{block_bytes / mib:.2f} MiB. Free memory, pass kv_cache_memory_bytes or "
            "num_kv_blocks explicitly, or use a smaller kv_block_size."
        )
    return num_blocks


def blocks_for_memory(memory_bytes: int, block_bytes: int) -> int:
    """Blocks in ``memory_bytes`` (``kv_cache_memory_bytes``); at least one must fit."""
    num_blocks = memory_bytes // block_bytes
    if num_blocks < 1:
        raise ConfigurationError(
            f"kv_cache_memory_bytes={memory_bytes} holds no KV block: one block needs "
            f"{block_bytes} bytes here. Give at least that, or use a smaller kv_block_size."
        )
    return num_blocks


def available_host_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Bytes of RAM available to new allocations (MemAvailable; free pages as a fallback)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the value is in kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def allocate_kv_cache(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The zero-filled cache tensor (see the module docstring for the layout).

    Zeros, not ``empty``: attention may read unwritten slots of a page before masking them
    out, and a NaN bit pattern there would survive the mask (``0 * NaN = NaN``). ``dtype`` is
    the resolved cache dtype (:func:`resolve_kv_cache_dtype`); float8 zeros are zero bytes.
    """
    shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
