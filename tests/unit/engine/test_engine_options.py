"""Engine options a newcomer meets: the CPU KV cache's default size, its knob, num_threads,
max_model_len against the model's limit, another tokenizer directory."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.kv_cache import CPU_KV_CACHE_WEIGHTS_MULTIPLE, kv_block_bytes
from pagedinfer.engine.config import DEFAULT_MAX_MODEL_LEN, default_num_threads
from pagedinfer.errors import ConfigurationError, UnsupportedModelError

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


@pytest.mark.usefixtures("restore_threads")
def test_num_threads_auto_is_the_default_and_none_leaves_torch_alone(checkpoint: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    assert default_num_threads() == max(1, cpus // 2)
    assert default_num_threads(tensor_parallel_size=2) == max(1, cpus // 4)
    other = default_num_threads() + 2
    torch.set_num_threads(other)
    with Engine(checkpoint, num_threads=None, **OPTIONS):  # a process-wide setting untouched
        assert torch.get_num_threads() == other
    with Engine(checkpoint, **OPTIONS):  # the default: "auto", as on the command line
        assert torch.get_num_threads() == default_num_threads()
    torch.set_num_threads(other)
    with Engine(checkpoint, num_threads="auto", **OPTIONS):
        assert torch.get_num_threads() == default_num_threads()
    with pytest.raises(ConfigurationError, match="'all' is invalid: expected an integer >= 1"):
        Engine(checkpoint, num_threads="all", **OPTIONS)


def test_max_model_len_beyond_the_models_limit_is_an_error_naming_it(
    make_checkpoint: Callable[..., Path],
) -> None:
    """It used to be lowered to the limit silently; the user learnt of it when a prompt that
    fitted what they asked for was refused."""
    checkpoint = make_checkpoint("tiny", max_position_embeddings=256)
    message = r"max_model_len=257 exceeds the model's context of 256 positions"
    with pytest.raises(ConfigurationError, match=message):
        Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=257)
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=256) as engine:
        assert engine.max_model_len == 256
    with Engine(checkpoint, device="cpu", kv_block_size=16) as engine:
        assert engine.max_model_len == 256  # the default, lowered to the model's limit


def test_the_default_max_model_len_is_4096_or_what_the_model_serves(
    checkpoint: Path, make_checkpoint: Callable[..., Path]
) -> None:
    with Engine(checkpoint, device="cpu", kv_block_size=16, num_kv_blocks=256) as engine:
        assert engine.max_model_len == DEFAULT_MAX_MODEL_LEN == 4096
    # A sliding window shorter than the default does not bound it: sliding layers attend
    # within their window at any length.
    mistral = make_checkpoint("tiny", architecture="MistralForCausalLM", sliding_window=64)
    with Engine(mistral, device="cpu", kv_block_size=16, num_kv_blocks=256) as engine:
        assert engine.max_model_len == 4096


def test_the_tokenizer_from_another_directory_or_none(
    make_checkpoint: Callable[..., Path], checkpoint: Path, tmp_path: Path
) -> None:
    with_tokenizer = make_checkpoint("tiny", with_tokenizer=True)
    with Engine(checkpoint, tokenizer=with_tokenizer, **OPTIONS) as engine:
        assert engine.tokenizer is not None
        (output,) = engine.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)
        assert output.prompt_token_ids == engine.tokenizer.encode("Hello")
    with Engine(with_tokenizer, skip_tokenizer_init=True, **OPTIONS) as engine:
        assert engine.tokenizer is None
        (output,) = engine.generate([[1, 2]], SamplingParams(max_tokens=3), use_tqdm=False)
        assert output.outputs[0].text == "" and len(output.outputs[0].token_ids) == 3
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        Engine(checkpoint, tokenizer=tmp_path / "missing", **OPTIONS)
    with pytest.raises(UnsupportedModelError, match="holds no tokenizer files"):
        Engine(checkpoint, tokenizer=tmp_path, **OPTIONS)
    with pytest.raises(ConfigurationError, match="contradict"):
        Engine(checkpoint, tokenizer=with_tokenizer, skip_tokenizer_init=True, **OPTIONS)
