"""The LoRA policy: never more distinct adapters among the running sequences (so in a step)
than ``max_loras``; the base model never counts; the queue stays first come, first served;
each adapter keys its own prefix-cache chain."""

from __future__ import annotations

import random

import pytest

from pagedinfer.domain import LoRARequest, SamplingParams, Scheduler, SchedulerConfig, Sequence
from pagedinfer.domain.hashing import chain_hashes
from pagedinfer.domain.lora import adapter_extra_key
from pagedinfer.domain.scheduler.adapter_limit import AdapterLimit, running_adapters
from pagedinfer.errors import InvalidRequestError

from ..driver import hash_sampler, step

ADAPTERS = [LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in range(1, 6)]


def _seq(seq_id: int, lora: LoRARequest | None, length: int = 6, max_tokens: int = 3) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(seq_id, list(range(1, length + 1)), params, lora=lora)


def _scheduler(max_loras: int, **config: object) -> Scheduler:
    settings = SchedulerConfig(64, 4, max_model_len=64, max_loras=max_loras, **config)  # type: ignore[arg-type]
    return Scheduler(settings)


def test_the_limit_counts_distinct_adapters_not_sequences_nor_the_base() -> None:
    limit = AdapterLimit(2)
    assert limit.admits(_seq(0, None), {1, 2})  # the base model never counts
    assert limit.admits(_seq(0, ADAPTERS[0]), {1, 2})  # already running
    assert not limit.admits(_seq(0, ADAPTERS[2]), {1, 2})
    assert limit.admits(_seq(0, ADAPTERS[2]), {1})
    assert running_adapters([_seq(0, ADAPTERS[0]), _seq(1, ADAPTERS[0]), _seq(2, None)]) == {1}


def test_a_third_adapter_waits_for_a_slot_and_blocks_the_queue_behind_it() -> None:
    scheduler = _scheduler(2)
    seqs = [_seq(0, ADAPTERS[0]), _seq(1, ADAPTERS[1]), _seq(2, ADAPTERS[2]), _seq(3, None)]
    for seq in seqs:
        scheduler.add(seq)
    first = step(scheduler, hash_sampler())
    assert first is not None
    assert sorted(first.plan.seq_ids) == [0, 1]  # adapter 3 waits, and the base request too
    assert [seq.seq_id for seq in scheduler.waiting] == [2, 3]
    seen_third = False
    while scheduler.has_unfinished():
        result = step(scheduler, hash_sampler())
        assert result is not None
        adapters = {seqs[i].lora.lora_int_id for i in result.plan.seq_ids if seqs[i].lora}  # type: ignore[union-attr]
        assert len(adapters) <= 2
        seen_third = seen_third or 3 in adapters
        scheduler.check_integrity()
    assert seen_third


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_never_exceeds_the_slots(seed: int) -> None:
    rng = random.Random(seed)
    max_loras = rng.randint(1, 3)
    scheduler = _scheduler(max_loras, max_num_batched_tokens=16)
    pending = [
        _seq(i, rng.choice([None, *ADAPTERS]), rng.randint(1, 10), rng.randint(1, 5))
        for i in range(30)
    ]
    by_id = {seq.seq_id: seq for seq in pending}
    steps = 0
    while pending or scheduler.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                scheduler.add(pending.pop(0))
        result = step(scheduler, hash_sampler())
        if result is not None:
            loras = {by_id[i].lora for i in result.plan.seq_ids} - {None}
            assert len(loras) <= max_loras
        assert len(running_adapters(scheduler.running)) <= max_loras
        scheduler.check_integrity()
        steps += 1
        assert steps < 2_000
    assert all(seq.finish_reason is not None for seq in by_id.values())


def test_a_scheduler_without_slots_refuses_an_adapter() -> None:
    scheduler = _scheduler(0)
    with pytest.raises(InvalidRequestError, match="max_loras=0"):
        scheduler.add(_seq(0, ADAPTERS[0]))
    assert not scheduler.has_unfinished()


def test_each_adapter_has_its_own_hash_chain() -> None:
    tokens = list(range(16))
    base = chain_hashes(tokens, 4, _seq(0, None).extra_key)
    first = chain_hashes(tokens, 4, _seq(1, ADAPTERS[0]).extra_key)
    again = chain_hashes(tokens, 4, _seq(2, ADAPTERS[0]).extra_key)
    second = chain_hashes(tokens, 4, _seq(3, ADAPTERS[1]).extra_key)
    assert first == again
    assert not set(base) & set(first)
    assert not set(first) & set(second)
    salted = adapter_extra_key(7, ADAPTERS[0])
    assert salted not in (7, 1, None) and salted != adapter_extra_key(7, ADAPTERS[1])


def test_a_base_prefix_is_not_reused_for_an_adapter() -> None:
    scheduler = _scheduler(2)
    scheduler.add(_seq(0, None, length=12, max_tokens=1))
    while scheduler.has_unfinished():
        step(scheduler, hash_sampler())
    adapted, base = _seq(1, ADAPTERS[0], length=12, max_tokens=1), _seq(2, None, length=12)
    scheduler.add(adapted)
    scheduler.add(base)
    step(scheduler, hash_sampler())
    assert adapted.num_cached_tokens == 0
    assert base.num_cached_tokens == 8  # two full blocks of 4 (the last is recomputed)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("", 1, "/p"), "lora_name"),
        (("a", 0, "/p"), "lora_int_id=0"),
        (("a", True, "/p"), "lora_int_id=True"),
        (("a", 1, ""), "lora_path"),
    ],
)
def test_lora_request_is_validated(args: tuple[object, ...], needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        LoRARequest(*args)  # type: ignore[arg-type]
