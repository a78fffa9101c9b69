"""The executor's and the scheduler's configurations, from the engine's
(engine/component_configs.py)."""

from __future__ import annotations

from typing import Any

import torch

from pagedinfer.engine.component_configs import runner_config, scheduler_config
from pagedinfer.engine.config import EngineConfig


def _runner(**options: Any) -> Any:
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


def test_the_runner_gets_the_options_and_what_was_resolved() -> None:
    config, runner = _runner(kv_block_size=8, max_num_seqs=3, seed=5, num_kv_blocks=40)
    assert (runner.model_path, runner.device, runner.dtype) == (
        "ckpt",
        torch.device("cpu"),
        torch.float32,
    )
    assert (runner.block_size, runner.max_num_seqs, runner.seed) == (8, 3, 5)
    assert (runner.max_model_len, runner.num_threads, runner.num_kv_blocks) == (96, 2, 40)
    assert runner.attention_backend == "torch"
    assert runner.num_speculative_tokens == 0 and runner.draft_model_path is None
    scheduler = scheduler_config(config, runner, num_blocks=40, eos_token_ids=[2, 3])
    assert (scheduler.num_blocks, scheduler.block_size, scheduler.max_model_len) == (40, 8, 96)
    assert scheduler.max_num_seqs == 3 and scheduler.eos_token_ids == frozenset({2, 3})
    assert scheduler.num_speculative_tokens == scheduler.num_lookahead_tokens == 0


def test_ngram_drafts_need_no_lookahead() -> None:
    speculative = {"method": "ngram", "num_speculative_tokens": 3}
    config, runner = _runner(speculative_config=speculative)
    assert runner.num_speculative_tokens == 3 and runner.draft_model_path is None
    scheduler = scheduler_config(config, runner, num_blocks=8, eos_token_ids=[])
    assert (scheduler.num_speculative_tokens, scheduler.num_lookahead_tokens) == (3, 0)


def test_a_draft_model_writes_its_next_drafts_ahead() -> None:
    speculative = {"method": "draft_model", "model": "draft", "num_speculative_tokens": 2}
    config, runner = _runner(speculative_config=speculative)
    assert runner.draft_model_path == "draft"
    scheduler = scheduler_config(config, runner, num_blocks=8, eos_token_ids=[])
    assert (scheduler.num_speculative_tokens, scheduler.num_lookahead_tokens) == (2, 2)
