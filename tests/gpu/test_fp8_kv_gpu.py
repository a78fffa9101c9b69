"""The FP8 KV cache on a real GPU (``make test-gpu``): the Triton store and attention kernels
compiled, CUDA graphs, and Qwen3-0.6B's shape with a sized cache.

The references are the same engine in float32 on the torch backend (which stores the same
bytes: the store kernels are bit-exact with the torch store, tests/unit/kernels/
test_kernel_fp8.py) and the same engine eagerly. In float32 both read identical K/V bytes and
differ only in the order of float32 sums, so greedy tokens must be identical, as
tests/gpu/test_engine_gpu.py requires of the float32 cache.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.cuda_graph import CudaGraphDecodeRunner
from pagedinfer.adapters.kv_cache import kv_block_bytes
from pagedinfer.adapters.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SMALL: dict[str, Any] = {
    "device": "cuda",
    "dtype": "float32",
    "kv_block_size": 16,
    "max_model_len": 256,
    "kv_cache_dtype": "fp8",
}


def _prompts(seed: int) -> list[list[int]]:
    """Six prompts of 1-120 tokens, then six sharing a 70-token prefix (whose blocks are the
    last freed, still cached for a second run)."""
    rng = random.Random(seed)
    system = [rng.randrange(512) for _ in range(70)]
    shared = [system + [rng.randrange(512) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    return [[rng.randrange(512) for _ in range(rng.randint(1, 120))] for _ in range(6)] + shared


def _runner(engine: Engine) -> ModelRunner:
    executor = engine._executor
    assert isinstance(executor, ModelRunner)
    return executor


def _tokens(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]


def test_triton_with_graphs_and_pressure_equals_the_torch_backend(
    make_checkpoint: Callable[..., Path],
) -> None:
    """Triton kernels and CUDA graphs, under prefix hits, preemption, chunked prefill and
    mixed steps, against the torch backend run eagerly with room to spare."""
    checkpoint = make_checkpoint("tiny")
    prompts = _prompts(11)
    with Engine(
        checkpoint, attention_backend="torch", enforce_eager=True, num_kv_blocks=200, **SMALL
    ) as engine:
        assert engine.kv_cache_dtype is torch.float8_e4m3fn
        expected = _tokens(engine, prompts)
    with Engine(
        checkpoint,
        attention_backend="triton",
        num_kv_blocks=20,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        **SMALL,
    ) as engine:
        graphs = _runner(engine).graph_runner
        assert isinstance(graphs, CudaGraphDecodeRunner)
        got = _tokens(engine, prompts)
        again = engine.generate(prompts[-3:], GREEDY, use_tqdm=False)
        stats, scheduler = engine.stats(), engine.scheduler.stats()
        replays = graphs.num_replays
    assert got == expected
    assert [o.outputs[0].token_ids for o in again] == expected[-3:]
    assert all(o.num_cached_tokens >= 64 for o in again)
    assert stats.num_preemptions > 0 and scheduler.num_mixed_steps > 0 and replays > 0


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_graphs_and_eager_give_the_same_greedy_tokens(
    make_checkpoint: Callable[..., Path], name: str
) -> None:
    checkpoint = make_checkpoint("tiny")
    prompts = _prompts(12)
    results = []
    for eager in (True, False):
        with Engine(
            checkpoint,
            attention_backend="triton",
            num_kv_blocks=400,
            enforce_eager=eager,
            **{**SMALL, "kv_cache_dtype": name},
        ) as engine:
            results.append(_tokens(engine, prompts))
    assert results[0] == results[1]


def test_qwen3_0_6b_shape_holds_twice_the_blocks_and_generates_with_graphs(
    make_checkpoint: Callable[..., Path],
) -> None:
    """bf16 weights, the same KV memory for a bf16 and an FP8 cache: twice the blocks, and
    the FP8 engine generates with graphs (scales calibrated at start-up)."""
    checkpoint = make_checkpoint("qwen3-0.6b")
    bf16_block = kv_block_bytes(
        num_layers=28, block_size=256, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16
    )
    settings: dict[str, Any] = {
        "device": "cuda",
        "kv_block_size": 256,
        "max_model_len": 2048,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 8192,
        "kv_cache_memory_bytes": 16 * bf16_block,
    }
    rng = random.Random(3)
    batch = [[rng.randrange(151936) for _ in range(rng.randint(10, 600))] for _ in range(16)]
    blocks = {}
    for dtype in ("auto", "fp8"):
        with Engine(checkpoint, kv_cache_dtype=dtype, **settings) as engine:
            blocks[dtype] = engine.stats().num_kv_blocks
            if dtype == "fp8":
                runner = _runner(engine)
                assert runner.kv_cache.dtype is torch.float8_e4m3fn
                assert runner.kv_cache.shape == (2, 28, blocks[dtype], 256, 8, 128)
                assert "(float8_e4m3fn)" in engine.describe()
                outputs = engine.generate(batch, GREEDY, use_tqdm=False)
                graphs = runner.graph_runner
                assert isinstance(graphs, CudaGraphDecodeRunner)
                assert graphs.num_replays == engine.scheduler.stats().num_decode_steps > 0
    assert blocks == {"auto": 16, "fp8": 32}
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
