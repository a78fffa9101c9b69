"""The KV cache's capacity logged at start-up (engine/kv_capacity.py): the pool, and per KV
group its layers, window and the most blocks (tokens of context) one sequence holds in it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer import Engine
from pagedinfer.domain.kv_groups import KVGroupSpec, group_layers
from pagedinfer.domain.scheduler import SchedulerConfig
from pagedinfer.engine.component_configs import runner_config, scheduler_config
from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.kv_capacity import kv_capacity_lines

LOGGER = "pagedinfer.engine.kv_capacity"


def test_a_gemma3_1b_shaped_pool_shows_sliding_layers_bounded_by_the_window() -> None:
    # Gemma 3 1B: 26 layers, five sliding (512) to one full: 7 groups of at most 4 layers.
    windows = [None if layer % 6 == 5 else 512 for layer in range(26)]
    config = SchedulerConfig(
        num_blocks=20_000,
        block_size=16,
        max_model_len=32_768,
        max_num_batched_tokens=2048,
        kv_groups=group_layers(windows),
    )
    lines = kv_capacity_lines(config)
    assert len(lines) == 1 + 7
    assert lines[0].startswith("KV cache: 20000 blocks of 16 tokens (320000 token slots)")
    # 2048 blocks in the full group, 33 in each of the six sliding groups.
    assert "holds at most 2246 blocks" in lines[0] and "8 such sequences" in lines[0]
    assert lines[1] == (
        "KV group 0: full attention, 4 layer(s) [5, 11, 17, 23]: up to 2048 blocks per "
        "sequence (its whole context, up to 32768 tokens)"
    )
    assert lines[2] == (
        "KV group 1: sliding window 512, 4 layer(s) [0-3]: at most 33 blocks per sequence "
        "between steps (the last 512 tokens of context; blocks before the window are freed)"
    )
    assert all("sliding window 512" in line and "at most 33 blocks" in line for line in lines[2:])


def test_a_plain_pool_is_one_line() -> None:
    config = SchedulerConfig(num_blocks=100, block_size=16, max_model_len=256)
    assert kv_capacity_lines(config) == [
        "KV cache: 100 blocks of 16 tokens (1600 token slots); a sequence of max_model_len=256 "
        "tokens holds 16 blocks: 6 such sequences fit at once"
    ]


def _configs(**options: Any) -> Any:
    config = EngineConfig.from_options("ckpt", options)  # type: ignore[arg-type]
    runner = runner_config(
        config,
        device=torch.device("cpu"),
        dtype=torch.float32,
        attention_backend="torch",
        max_model_len=96,
        num_threads=2,
    )
    return config, runner


def test_a_window_kept_in_plain_tables_says_so(caplog: pytest.LogCaptureFixture) -> None:
    config, runner = _configs(kv_block_size=16)
    sliding = (KVGroupSpec(window=32, layers=(0, 1)),)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        scheduler = scheduler_config(
            config, runner, num_blocks=6, eos_token_ids=[], kv_groups=sliding
        )
    assert scheduler.kv_groups == ()
    messages = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert "one plain table per sequence" in messages[0] and "window 32" in messages[0]
    assert messages[1].startswith("KV cache: 6 blocks of 16 tokens")


def test_the_engine_logs_each_group_at_start_up(
    make_checkpoint: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = make_checkpoint(
        "tiny",
        architecture="Gemma3ForCausalLM",
        num_hidden_layers=3,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        sliding_window=8,
        query_pre_attn_scalar=24,
        tie_word_embeddings=False,
        vocab_size=256,
    )
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine = Engine(
            checkpoint, device="cpu", kv_block_size=16, max_model_len=96, num_kv_blocks=64
        )
    with engine:
        usage = engine.stats().kv_groups
    messages = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert messages == [
        "KV cache: 64 blocks of 16 tokens (1024 token slots) shared by 3 KV group(s) (one block "
        "is the null block); a sequence of max_model_len=96 tokens holds at most 10 blocks "
        "across them between steps: 6 such sequences fit at once",
        "KV group 0: full attention, 1 layer(s) [2]: up to 6 blocks per sequence (its whole "
        "context, up to 96 tokens)",
        "KV group 1: sliding window 8, 1 layer(s) [0]: at most 2 blocks per sequence between "
        "steps (the last 8 tokens of context; blocks before the window are freed)",
        "KV group 2: sliding window 8, 1 layer(s) [1]: at most 2 blocks per sequence between "
        "steps (the last 8 tokens of context; blocks before the window are freed)",
    ]
    # The same bound as the stats report.
    assert [u.max_blocks_per_sequence for u in usage] == [None, 2, 2]
