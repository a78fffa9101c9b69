"""KV-cache sizing from the GPU memory budget, on a real GPU. Run with ``make test-gpu``.

``num_blocks = (total * gpu_memory_utilization - used - peak + current) // block_bytes``
after a warm-up prefill (see ``adapters/kv_cache.py``): more utilization gives more blocks,
in proportion; the cache stays inside the budget; what the warm-up needs on top of the
weights (here: the sampled rows' logits) is left free; an impossible budget is a clear error.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer import Engine
from pagedinfer.adapters.kv_cache import kv_block_bytes
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.errors import KVCacheMemoryError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK_SIZE = 256
# The tiny preset: 2 layers, 2 kv heads of 32 dims; float32 pages of 256 tokens = 256 KiB.
BLOCK_BYTES = kv_block_bytes(
    num_layers=2, block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=32, dtype=torch.float32
)
MIB = 1 << 20


def _release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _sized_engine(checkpoint: Path, **overrides: Any) -> Engine:
    settings: dict[str, Any] = {
        "device": "cuda",
        "dtype": "float32",
        "attention_backend": "triton",
        "kv_block_size": BLOCK_SIZE,
        "max_model_len": 1024,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 2048,
    }
    settings.update(overrides)
    _release()
    return Engine(checkpoint, **settings)


def _blocks_and_usage(checkpoint: Path, utilization: float) -> tuple[int, int]:
    """KV blocks of an engine sized at ``utilization`` and the device memory in use after it
    was built (KV cache, weights, graphs and all); checks the cache tensor on the way."""
    with _sized_engine(checkpoint, gpu_memory_utilization=utilization) as engine:
        runner = engine._executor
        assert isinstance(runner, ModelRunner)
        num_blocks = engine.stats().num_kv_blocks
        assert runner.num_kv_blocks == num_blocks
        assert runner.kv_cache.shape == (2, 2, num_blocks, BLOCK_SIZE, 2, 32)
        assert runner.kv_cache.numel() * runner.kv_cache.element_size() == num_blocks * BLOCK_BYTES
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used = total - free
    _release()
    return num_blocks, used


def test_more_utilization_gives_proportionally_more_blocks(
    make_checkpoint: Callable[..., Path],
) -> None:
    checkpoint = make_checkpoint("tiny")
    total = torch.cuda.mem_get_info()[1]
    low, used_low = _blocks_and_usage(checkpoint, 0.3)
    high, used_high = _blocks_and_usage(checkpoint, 0.6)
    assert 0 < low < high
    # The extra 30% of the device all goes to the cache (within 2% of the device).
    assert abs((high - low) * BLOCK_BYTES - 0.3 * total) < 0.02 * total
    for blocks, used, utilization in ((low, used_low, 0.3), (high, used_high, 0.6)):
        assert blocks * BLOCK_BYTES <= total * utilization
        # Everything the engine holds stays inside the budget, up to the graphs' memory.
        assert used <= total * utilization + 256 * MIB, (used, total, utilization)


def test_warm_up_peak_is_left_free(make_checkpoint: Callable[..., Path]) -> None:
    """Sampling 512 rows instead of 8 needs (at least) 504 more rows of logits at the peak;
    the budget leaves them free, so the cache gets that many bytes fewer."""
    vocab = 32768
    checkpoint = make_checkpoint("tiny", vocab_size=vocab)
    blocks = {}
    for max_num_seqs in (8, 512):
        with _sized_engine(
            checkpoint, gpu_memory_utilization=0.3, max_num_seqs=max_num_seqs
        ) as engine:
            blocks[max_num_seqs] = engine.stats().num_kv_blocks
        _release()
    logits_bytes = (512 - 8) * vocab * 4  # float32 rows of the vocabulary
    assert (blocks[8] - blocks[512]) * BLOCK_BYTES >= 0.9 * logits_bytes, blocks


def test_an_impossible_budget_is_a_clear_error(make_checkpoint: Callable[..., Path]) -> None:
    checkpoint = make_checkpoint("tiny")
    # 0.01% of the device is less than the CUDA context alone.
    with pytest.raises(KVCacheMemoryError, match=r"gpu_memory_utilization 0\.0001") as info:
        _sized_engine(checkpoint, gpu_memory_utilization=1e-4)
    message = str(info.value)
    assert "GiB" in message and "one block needs" in message
    assert isinstance(info.value, RuntimeError)
    del info  # its traceback holds the half-built runner
    _release()
