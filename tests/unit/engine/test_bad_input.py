"""SPEC §6: every bad input gets a clear, typed error and the engine keeps serving."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedinfer import Engine, SamplingParams
from pagedinfer.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    KVCacheMemoryError,
    UnsupportedModelError,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [7] * 20, [9, 8, 7]]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[Engine]:
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64) as engine:
        yield engine


@pytest.fixture(scope="module")
def expected(engine: Engine) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _still_serves(engine: Engine, expected: list[list[int]]) -> None:
    outputs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert not engine.has_unfinished_requests()
    assert engine.stats().kv_cache_usage == 0.0


@pytest.mark.parametrize("prompt", ["", []], ids=["empty-text", "empty-ids"])
def test_empty_prompt(engine: Engine, expected: list[list[int]], prompt: str | list[int]) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1, 2], prompt], GREEDY, use_tqdm=False)
    _still_serves(engine, expected)


@pytest.mark.parametrize("bad_id", [-1, 512, 10**6])
def test_token_id_out_of_range(engine: Engine, expected: list[list[int]], bad_id: int) -> None:
    with pytest.raises(ValueError, match=str(bad_id)) as error:
        engine.add_request([1, bad_id, 2], GREEDY)
    assert isinstance(error.value, InvalidRequestError)
    with pytest.raises(ValueError, match=str(bad_id)):
        engine.generate([[3, 4], [bad_id]], GREEDY, use_tqdm=False)
    _still_serves(engine, expected)


def test_prompt_too_long(engine: Engine, expected: list[list[int]]) -> None:
    with pytest.raises(ValueError, match=r"64.*64|64") as error:
        engine.add_request([1] * 64, GREEDY)
    message = str(error.value)
    assert "64 tokens" in message and "max_model_len=64" in message
    engine.add_request([1] * 63, SamplingParams(max_tokens=5))  # the longest prompt that fits
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.outputs[0].finish_reason in (None, "length")
    _still_serves(engine, expected)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("max_tokens", 0),
        ("stop_token_ids", [-3]),
        ("stop", [""]),
    ],
)
def test_invalid_sampling_params(
    engine: Engine, expected: list[list[int]], field: str, value: object
) -> None:
    with pytest.raises(ValueError, match=field) as error:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert isinstance(error.value, InvalidSamplingParamsError)
    with pytest.raises(ValueError, match=r"got 2 SamplingParams for \d+ prompts"):
        engine.generate(PROMPTS, [GREEDY, GREEDY], use_tqdm=False)  # wrong count
    with pytest.raises(ValueError, match="sampling params must be a SamplingParams, not dict"):
        engine.add_request([1, 2], {"temperature": 0.0})  # type: ignore[arg-type]
    _still_serves(engine, expected)


def test_text_prompt_without_tokenizer(make_checkpoint: Callable[..., Path]) -> None:
    checkpoint = make_checkpoint("tiny")
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64) as engine:
        assert engine.tokenizer is None
        with pytest.raises(ValueError, match="tokenizer"):
            engine.add_request("hello", GREEDY)
        (output,) = engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert output.outputs[0].text == "" and len(output.outputs[0].token_ids) == 6


def test_model_path_missing(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model") as error:
        Engine(missing, device="cpu")
    assert isinstance(error.value, CheckpointNotFoundError)


def test_unsupported_architecture(checkpoint: Path, tmp_path: Path) -> None:
    copy = tmp_path / "llama"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MambaForCausalLM") as error:
        Engine(copy, device="cpu")
    assert isinstance(error.value, UnsupportedModelError)
    assert str(copy) in str(error.value)


def test_missing_weights(checkpoint: Path, tmp_path: Path) -> None:
    copy = tmp_path / "no-weights"
    shutil.copytree(checkpoint, copy)
    for weights in copy.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ValueError, match="safetensors") as error:
        Engine(copy, device="cpu", kv_block_size=16, max_model_len=64)
    assert isinstance(error.value, UnsupportedModelError)
    assert str(copy) in str(error.value)


def test_pool_smaller_than_one_sequence(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len") as error:
        Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64, num_kv_blocks=3)
    assert isinstance(error.value, ConfigurationError)
    assert "48" in str(error.value) and "64" in str(error.value)  # 3 x 16 tokens vs 64


def test_block_size_not_supported_by_backend(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="block") as error:
        Engine(checkpoint, device="cpu", attention_backend="triton", kv_block_size=8)
    assert "8" in str(error.value)


def test_not_enough_memory_for_one_block(checkpoint: Path) -> None:
    # One block of 2**24 tokens needs gigabytes: more than the CPU sizing allows.
    with pytest.raises(RuntimeError) as error:
        Engine(checkpoint, device="cpu", kv_block_size=2**24, max_model_len=64)
    assert isinstance(error.value, KVCacheMemoryError)
    assert any(ch.isdigit() for ch in str(error.value))


def test_unknown_engine_keyword(checkpoint: Path) -> None:
    with pytest.raises(TypeError, match="block_sz"):
        Engine(checkpoint, device="cpu", block_sz=16)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", -1),
        ("max_model_len", 1),
        ("gpu_memory_utilization", 1.5),
        ("attention_backend", "cudnn"),
        ("dtype", "int8"),
        ("device", "tpu"),
        ("tensor_parallel_size", 0),
    ],
)
def test_invalid_engine_settings(checkpoint: Path, keyword: str, value: object) -> None:
    with pytest.raises(ValueError, match=keyword if keyword != "device" else "device"):
        Engine(checkpoint, **{keyword: value})  # type: ignore[arg-type]
