"""The engine's counters (engine/stats.py)."""

from __future__ import annotations

import pytest

from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.scheduler import Scheduler, SchedulerConfig
from pagedinfer.domain.sequence import Sequence
from pagedinfer.engine.stats import EngineStats, StepAccounting


def test_a_mixed_step_shares_its_time_by_token_counts() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=32))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    scheduler.add(Sequence(0, [1, 2, 3], params))
    prefill = scheduler.schedule()
    assert prefill is not None
    scheduler.postprocess(prefill, [9])
    scheduler.add(Sequence(1, [4, 5, 6], params))
    mixed = scheduler.schedule()  # one decode row and a 3-token prompt
    assert mixed is not None and mixed.num_tokens == 4
    counts = StepAccounting()
    counts.add(prefill, 1, 3.0)
    counts.add(mixed, 2, 2.0)
    assert (counts.prompt_tokens, counts.generated_tokens) == (6, 3)
    assert counts.prefill_seconds == pytest.approx(3.0 + 1.5)
    assert counts.decode_seconds == pytest.approx(0.5)
    assert counts.last_step == (True, 3, 2.0)
    counts.discount(1)  # a sample after a rejected draft
    assert counts.generated_tokens == 2
    assert counts.decode_throughput == pytest.approx(2 / 0.5)
    assert counts.prefill_throughput == pytest.approx(6 / 4.5)


def test_nothing_recorded_is_zero_throughput() -> None:
    counts = StepAccounting()
    assert counts.prefill_throughput == counts.decode_throughput == 0.0


def test_speculative_rates() -> None:
    stats = EngineStats(
        num_requests_finished=0,
        num_waiting=0,
        num_running=0,
        num_prompt_tokens=0,
        num_generated_tokens=0,
        prefill_throughput=0.0,
        decode_throughput=0.0,
        prefix_cache_hit_rate=0.0,
        kv_cache_usage=0.0,
        num_kv_blocks=1,
        num_preemptions=0,
    )
    assert stats.spec_decode_acceptance_rate == stats.spec_decode_mean_acceptance_length == 0.0
    stats = EngineStats(
        **{
            **{name: getattr(stats, name) for name in EngineStats.__dataclass_fields__},
            "spec_decode_num_drafts": 2,
            "spec_decode_num_draft_tokens": 8,
            "spec_decode_num_accepted_tokens": 6,
        }
    )
    assert stats.spec_decode_acceptance_rate == pytest.approx(0.75)
    assert stats.spec_decode_mean_acceptance_length == pytest.approx(4.0)
