"""How many KV blocks a runner allocates (``adapters/kv_sizing.py``), and the warm-up plan."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedinfer.adapters import kv_sizing
from pagedinfer.adapters.kv_sizing import kv_cache_blocks, warm_up_plan
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain.plan import PADDING_SLOT
from pagedinfer.errors import ConfigurationError

BLOCK_BYTES = 1000


def _config(device: str = "cpu", **overrides: Any) -> RunnerConfig:
    settings: dict[str, Any] = {
        "model_path": "unused",
        "device": torch.device(device),
        "dtype": torch.float32,
        "block_size": 16,
        "attention_backend": "torch",
        "max_num_seqs": 4,
        "max_num_batched_tokens": 256,
        "max_model_len": 64,
    }
    return RunnerConfig(**{**settings, **overrides})


def _never() -> int:
    raise AssertionError("the CUDA budget was measured")


def _blocks(config: RunnerConfig, cuda_budget: Any = _never) -> int:
    model = torch.nn.Linear(10, 10)  # 110 float32 parameters: 440 bytes of weights
    return kv_cache_blocks(config, block_bytes=BLOCK_BYTES, model=model, cuda_budget=cuda_budget)


def test_a_configured_number_of_blocks_wins() -> None:
    assert _blocks(_config(num_kv_blocks=7, kv_cache_memory_bytes=10**9)) == 7
    assert _blocks(_config("cuda", num_kv_blocks=3)) == 3  # no warm-up pass


def test_a_number_of_blocks_below_one_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigurationError, match=r"num_kv_blocks=0 .*>= 1 .*None"):
        _blocks(_config(num_kv_blocks=0))


def test_a_memory_size_is_divided_by_the_block_bytes() -> None:
    assert _blocks(_config(kv_cache_memory_bytes=10_500)) == 10
    assert _blocks(_config("cuda", kv_cache_memory_bytes=10_500)) == 10


def test_cuda_without_a_size_measures_the_budget() -> None:
    assert _blocks(_config("cuda"), cuda_budget=lambda: 42) == 42


def test_the_cpu_takes_at_most_what_the_sequences_can_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_sizing, "available_host_memory", lambda: 10**12)
    # Weights of 440 bytes allow few blocks; the floor is one max_model_len sequence.
    assert _blocks(_config()) == 64 // 16


def test_the_warm_up_plan_fills_a_step_without_storing_anything() -> None:
    plan = warm_up_plan(
        _config(max_model_len=80, max_num_batched_tokens=200, max_num_seqs=6, block_size=16)
    )
    assert plan.is_prefill and plan.num_tokens == 200
    assert plan.query_lens.tolist() == [80, 80, 40]  # max_model_len sequences, the last shorter
    assert plan.positions.tolist() == [*range(80), *range(80), *range(40)]
    assert plan.num_samples == 6 and set(plan.sample_slots) == {0}
    assert set(plan.slot_mapping) == {PADDING_SLOT}
    assert plan.block_table_width == 5 and set(plan.block_tables) == {0}
    (request,) = plan.new_requests  # top-k and top-p: the sampler's sort is measured
    assert request.params.top_k == 50 and request.params.top_p == 0.9


def test_the_warm_up_plan_is_bounded_by_the_sequences_it_may_hold() -> None:
    plan = warm_up_plan(_config(max_model_len=32, max_num_batched_tokens=1000, max_num_seqs=2))
    assert plan.query_lens.tolist() == [32, 32]
    assert plan.num_samples == 2
