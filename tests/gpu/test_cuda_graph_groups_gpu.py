"""CUDA-graph decode of hybrid-attention models (KV groups) on a real GPU.

A tiny Gemma 3 (two sliding layers with an 8-token window to one full layer: three KV
groups) and a tiny GPT-OSS (a sliding and a full layer, sinks, the fused MoE: two groups)
capture their decode graphs with a block table per group; prompts several windows long
decode through the graphs (the sliding groups' tables fill with null entries as the window
moves) and give the same greedy tokens as the same engine with ``enforce_eager``. Gemma 3's
replayed hidden states equal the eager forward pass over the same inputs at every step while
the batch shrinks through buckets. Run with ``make test-gpu``.
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
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain import Scheduler, SchedulerConfig, Sequence

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 256
WINDOW = 8


SHAPES: dict[str, dict[str, Any]] = {
    "gemma3": {
        "architecture": "Gemma3ForCausalLM",
        "num_hidden_layers": 3,
        "layer_types": ("sliding_attention", "sliding_attention", "full_attention"),
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 24,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB,
    },
    "gpt-oss": {
        "architecture": "GptOssForCausalLM",
        "layer_types": ("sliding_attention", "full_attention"),
        "sliding_window": WINDOW,
        "attention_bias": True,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB,
    },
}
WINDOWS = {"gemma3": [None, WINDOW, WINDOW], "gpt-oss": [None, WINDOW]}


@pytest.fixture(scope="module")
def gemma3_checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", **SHAPES["gemma3"])


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 60))] for _ in range(count)]


def engine_tokens(
    checkpoint: Path, windows: list[int | None], *, enforce_eager: bool
) -> tuple[list[list[int]], int]:
    """Greedy tokens of 12 prompts finishing at different steps, and the graph replays."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 2 * i, ignore_eos=True) for i in range(12)
    ]
    with Engine(
        checkpoint,
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        kv_block_size=16,
        max_model_len=256,
        max_num_seqs=16,
        num_kv_blocks=256,
        enforce_eager=enforce_eager,
    ) as engine:
        runner = engine._executor
        assert isinstance(runner, ModelRunner)
        assert [g.window for g in runner.kv_groups] == windows
        graphs = runner.graph_runner
        if enforce_eager:
            assert graphs is None
        else:
            assert isinstance(graphs, CudaGraphDecodeRunner)
            assert graphs.static.num_groups == graphs.layout.num_groups == len(windows)
        outputs = engine.generate(prompts(0, 12), params, use_tqdm=False)
        replays = graphs.num_replays if isinstance(graphs, CudaGraphDecodeRunner) else 0
    return [list(output.outputs[0].token_ids) for output in outputs], replays


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_graphs_and_eager_decode_the_same_tokens(
    make_checkpoint: Callable[..., Path], shape: str
) -> None:
    checkpoint = make_checkpoint("tiny", **SHAPES[shape])
    eager, _ = engine_tokens(checkpoint, WINDOWS[shape], enforce_eager=True)
    graphed, replays = engine_tokens(checkpoint, WINDOWS[shape], enforce_eager=False)
    assert replays > 0
    assert graphed == eager


def test_replay_matches_the_eager_forward_pass_per_step(gemma3_checkpoint: Path) -> None:
    runner = ModelRunner(
        RunnerConfig(
            model_path=str(gemma3_checkpoint),
            device=torch.device("cuda", torch.cuda.current_device()),
            dtype=torch.float32,
            block_size=16,
            attention_backend="triton",
            max_num_seqs=10,
            max_num_batched_tokens=1024,
            max_model_len=512,
            num_kv_blocks=256,
        )
    )
    graphs = runner.graph_runner
    assert isinstance(graphs, CudaGraphDecodeRunner)
    config = runner.config
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=runner.num_kv_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            kv_groups=runner.kv_groups,
        )
    )
    # 10 sequences finishing a step apart: decode batches of 10, 9, ..., 1.
    for index, prompt in enumerate(prompts(1, 10)):
        params = SamplingParams(temperature=0.0, max_tokens=2 + index, ignore_eos=True)
        scheduler.add(Sequence(index, prompt, params))
    batch_sizes = []
    while (plan := scheduler.schedule()) is not None:
        if not plan.is_prefill:
            assert graphs.can_replay(plan) and len(plan.group_block_tables) == 2
            batch_sizes.append(plan.num_seqs)
            inputs = runner.prepare(plan)  # every group's rows, in the static inputs
            assert inputs.graph_batch is not None
            with torch.inference_mode():
                eager = runner.model(inputs.input_ids, inputs.positions, inputs.meta).float()
                replayed = graphs.replay(inputs.graph_batch, plan.num_seqs).float()
            torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
        scheduler.postprocess(plan, runner.execute(plan).sampled_token_ids)
    assert batch_sizes == list(range(10, 0, -1))
    runner.close()
