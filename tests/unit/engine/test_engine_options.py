"""Engine options a newcomer meets: the CPU KV cache's default size, its knob, num_threads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.kv_cache import CPU_KV_CACHE_WEIGHTS_MULTIPLE, kv_block_bytes
from pagedinfer.errors import ConfigurationError

OPTIONS = {"device": "cpu", "kv_block_size": 16, "max_model_len": 128}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny")


def _block_bytes(engine: Engine) -> int:
    config = engine.model_config
    return kv_block_bytes(
        num_layers=config.num_hidden_layers,
        block_size=16,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=engine.dtype,
    )


def test_the_default_cpu_cache_is_sized_from_the_model_not_from_ram(checkpoint: Path) -> None:
    with Engine(checkpoint, **OPTIONS) as engine:
        runner = engine._executor
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())  # type: ignore[union-attr]
        expected = max(
            128 // 16, CPU_KV_CACHE_WEIGHTS_MULTIPLE * weight_bytes // _block_bytes(engine)
        )
        assert engine.stats().num_kv_blocks == expected
        assert expected * _block_bytes(engine) < 64 << 20  # not a quarter of the machine's RAM


def test_kv_cache_memory_bytes_sizes_the_cache(checkpoint: Path) -> None:
    with Engine(checkpoint, **OPTIONS) as probe:
        block = _block_bytes(probe)
    with Engine(checkpoint, kv_cache_memory_bytes=20 * block + 7, **OPTIONS) as engine:
        assert engine.stats().num_kv_blocks == 20
        (output,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 4


def test_the_two_cache_sizes_exclude_each_other(checkpoint: Path) -> None:
    with pytest.raises(ConfigurationError, match="pass only one"):
        Engine(checkpoint, num_kv_blocks=16, kv_cache_memory_bytes=1 << 20, **OPTIONS)
    with pytest.raises(ConfigurationError, match="kv_cache_memory_bytes"):
        Engine(checkpoint, kv_cache_memory_bytes=0, **OPTIONS)
    with pytest.raises(ConfigurationError, match="holds no KV block"):
        Engine(checkpoint, kv_cache_memory_bytes=100, **OPTIONS)


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("restore_threads")
def test_num_threads_sets_torchs_cpu_threads(checkpoint: Path) -> None:
    with Engine(checkpoint, num_threads=1, **OPTIONS) as engine:
        assert torch.get_num_threads() == 1
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ConfigurationError, match="num_threads"):
        Engine(checkpoint, num_threads=0, **OPTIONS)
