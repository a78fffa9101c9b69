"""KV-cache sizing rules (pure functions of plain numbers) and the cache tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedinfer.adapters.kv_cache import (
    CPU_KV_CACHE_MEMORY_FRACTION,
    CPU_KV_CACHE_WEIGHTS_MULTIPLE,
    allocate_kv_cache,
    available_host_memory,
    blocks_for_memory,
    cpu_kv_block_budget,
    cuda_kv_block_budget,
    kv_block_bytes,
    max_useful_blocks,
)
from pagedinfer.errors import ConfigurationError, KVCacheMemoryError

GIB = 1 << 30
MIB = 1 << 20


def test_block_bytes_counts_keys_values_layers_and_dtype() -> None:
    # Qwen3-0.6B, 256-token blocks, bf16: 2 * 28 * 256 * 8 * 128 * 2 bytes = 28 MiB.
    size = kv_block_bytes(
        num_layers=28, block_size=256, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16
    )
    assert size == 28 * MIB
    assert (
        kv_block_bytes(num_layers=1, block_size=16, num_kv_heads=2, head_dim=4, dtype=torch.float32)
        == 2 * 16 * 2 * 4 * 4
    )


def test_cuda_budget_is_nano_vllms_formula() -> None:
    # 80 GiB * 0.9 = 72 GiB; 10 GiB used; the warm-up peaked 4 GiB above what is allocated now.
    blocks = cuda_kv_block_budget(
        total=80 * GIB,
        used=10 * GIB,
        peak=6 * GIB,
        current=2 * GIB,
        utilization=0.9,
        block_bytes=28 * MIB,
    )
    assert blocks == (int(80 * GIB * 0.9) - 10 * GIB - 4 * GIB) // (28 * MIB)


def test_cuda_budget_rounds_down_to_whole_blocks() -> None:
    blocks = cuda_kv_block_budget(
        total=1000, used=0, peak=0, current=0, utilization=1.0, block_bytes=300
    )
    assert blocks == 3


@pytest.mark.parametrize("used", [79 * GIB, 90 * GIB])
def test_cuda_budget_without_room_names_the_numbers(used: int) -> None:
    with pytest.raises(KVCacheMemoryError) as info:
        cuda_kv_block_budget(
            total=80 * GIB,
            used=used,
            peak=2 * GIB,
            current=1 * GIB,
            utilization=0.9,
            block_bytes=28 * MIB,
        )
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert "80.00 GiB" in message and "0.9" in message and "gpu_memory_utilization" in message


def test_cpu_budget_takes_a_fraction_of_available_memory() -> None:
    blocks = cpu_kv_block_budget(available=8 * GIB, block_bytes=MIB, max_blocks=10**9)
    assert blocks == int(8 * GIB * CPU_KV_CACHE_MEMORY_FRACTION) // MIB
    assert (
        cpu_kv_block_budget(available=8 * GIB, block_bytes=MIB, max_blocks=10**9, fraction=0.5)
        == 4096
    )


def test_cpu_budget_is_capped_at_what_can_be_used() -> None:
    cap = max_useful_blocks(max_num_seqs=4, max_model_len=100, block_size=16)
    assert cap == 4 * 7
    assert cpu_kv_block_budget(available=64 * GIB, block_bytes=MIB, max_blocks=cap) == cap


def test_cpu_budget_without_room_names_the_numbers() -> None:
    with pytest.raises(KVCacheMemoryError, match="num_kv_blocks") as info:
        cpu_kv_block_budget(available=3 * MIB, block_bytes=2 * MIB, max_blocks=100)
    assert "3.0 MiB" in str(info.value)


def test_available_memory_reads_memavailable(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree: 1000 kB\nMemAvailable:   2048 kB\n")
    assert available_host_memory(meminfo) == 2048 * 1024


def test_available_memory_falls_back_without_proc(tmp_path: Path) -> None:
    assert available_host_memory(tmp_path / "missing") > 0


def test_allocated_cache_is_zeroed_with_the_documented_layout() -> None:
    cache = allocate_kv_cache(
        num_layers=3,
        num_blocks=5,
        block_size=16,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float16,
        device=torch.device("cpu"),
    )
    assert cache.shape == (2, 3, 5, 16, 2, 8)
    assert cache.dtype is torch.float16
    assert not cache.any()


def test_cpu_budget_is_capped_at_a_multiple_of_the_weights() -> None:
    """A tiny model gets a tiny cache (issue 11.11: the demo took 5.8 GB for its cache)."""
    blocks = cpu_kv_block_budget(
        available=24 * GIB, block_bytes=MIB, max_blocks=8192, min_blocks=16, weight_bytes=16 * MIB
    )
    assert blocks == CPU_KV_CACHE_WEIGHTS_MULTIPLE * 16
    # ... but never below one max_model_len sequence, and never above the RAM fraction.
    assert (
        cpu_kv_block_budget(
            available=24 * GIB, block_bytes=MIB, max_blocks=8192, min_blocks=100, weight_bytes=MIB
        )
        == 100
    )
    assert (
        cpu_kv_block_budget(
            available=64 * MIB, block_bytes=MIB, max_blocks=8192, min_blocks=100, weight_bytes=MIB
        )
        == 16
    )


def test_memory_knob_counts_whole_blocks() -> None:
    assert blocks_for_memory(10 * MIB + 5, MIB) == 10
    with pytest.raises(ConfigurationError, match="kv_cache_memory_bytes=1000"):
        blocks_for_memory(1000, MIB)
