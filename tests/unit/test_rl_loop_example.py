"""``examples/rl_loop.py`` at a small size, in this process (torch and transformers are loaded
already; a subprocess would spend seconds importing them again): the engine's logprobs of its
rollouts equal the trainer's recomputation every round, after weight updates that moved
every round's weights (issue 40)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("rl_loop_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_rl_loop_keeps_engine_and_trainer_logprobs_equal(
    make_checkpoint: Callable[..., Path],
) -> None:
    rounds = _example().train(
        str(make_checkpoint("tiny")),
        rounds=3,
        num_prompts=2,
        group=4,
        max_tokens=6,
        target_below=64,
        lr=3e-2,
    )
    assert len(rounds) == 3
    for result in rounds:
        assert result.max_logprob_gap < 2e-4  # float32, raw_logprobs
        assert result.max_weight_change > 1e-3  # each round trained on new weights
    assert rounds[0].mean_reward > 0  # the reward varies, so the gradient is not zero
