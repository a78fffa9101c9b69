"""The paged KV cache: its one tensor, and how many blocks of it fit in memory.

Layout: ``[2, num_layers, num_blocks, block_size, num_kv_heads_per_rank, head_dim]``; index 0
holds keys, 1 values, and attention layer ``i`` works on the views ``cache[0, i]`` and
``cache[1, i]``. The sizing rules are pure functions of plain numbers so they can be tested
without the memory they describe.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pagedinfer.errors import ConfigurationError, KVCacheMemoryError

__all__ = [
    "CPU_KV_CACHE_MEMORY_FRACTION",
    "CPU_KV_CACHE_WEIGHTS_MULTIPLE",
    "allocate_kv_cache",
    "available_host_memory",
    "blocks_for_memory",
    "cpu_kv_block_budget",
    "cuda_kv_block_budget",
    "kv_block_bytes",
    "max_useful_blocks",
]

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
    """Bytes of one block across all layers, keys and values (``num_kv_heads`` per rank)."""
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
    out, and a NaN bit pattern there would survive the mask (``0 * NaN = NaN``).
    """
    shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
