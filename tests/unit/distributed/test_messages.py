"""What crosses the control channel each step: the model's part of the plan, and no more."""

from __future__ import annotations

import dataclasses
import pickle
import random

from pagedinfer.adapters.distributed.messages import (
    EXECUTE,
    SAMPLER_ONLY_FIELDS,
    execute_message,
)
from pagedinfer.domain import (
    BatchPlan,
    LoRARequest,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
)

BLOCK = 16


def first_decode_plan(num_seqs: int, prompt_len: int) -> BatchPlan:
    """Prefill ``num_seqs`` random prompts of ``prompt_len`` tokens; return the first decode."""
    config = SchedulerConfig(
        num_blocks=num_seqs * (prompt_len // BLOCK + 2),
        block_size=BLOCK,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=num_seqs * prompt_len,
        max_model_len=prompt_len + 2 * BLOCK,
    )
    scheduler = Scheduler(config)
    rng = random.Random(num_seqs * prompt_len)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=3, max_tokens=8)
    for seq_id in range(num_seqs):
        scheduler.add(Sequence(seq_id, [rng.randrange(50_000) for _ in range(prompt_len)], params))
    while True:
        plan = scheduler.schedule()
        assert plan is not None
        if not plan.is_prefill:
            return plan
        scheduler.postprocess(plan, [7] * plan.num_samples)


def test_workers_get_every_model_field_and_no_sampler_field() -> None:
    plan = first_decode_plan(num_seqs=8, prompt_len=40)
    command, sent = pickle.loads(pickle.dumps(execute_message(plan)))
    assert command == EXECUTE
    for field in dataclasses.fields(BatchPlan):
        if field.name in SAMPLER_ONLY_FIELDS:
            assert not getattr(sent, field.name), field.name
        else:
            assert getattr(sent, field.name) == getattr(plan, field.name), field.name
    assert sent.num_samples == plan.num_samples  # workers compute logits for these rows
    assert plan.sample_slots, "the original plan is left as it was"


def test_the_first_plan_of_a_request_carries_its_sampling_parameters_only_to_rank_0() -> None:
    config = SchedulerConfig(num_blocks=8, block_size=BLOCK, max_model_len=64)
    scheduler = Scheduler(config)
    params = SamplingParams(temperature=0.7, seed=3)
    scheduler.add(Sequence(0, [1, 2, 3], params))
    plan = scheduler.schedule()
    assert plan is not None
    assert [(r.seq_id, r.slot, r.params, r.num_prompt_tokens) for r in plan.new_requests] == [
        (0, 0, params, 3)
    ]
    _, sent = execute_message(plan)
    assert sent.new_requests == () and sent.released_slots == ()


def test_a_decode_message_does_not_grow_with_the_token_history() -> None:
    short = len(pickle.dumps(execute_message(first_decode_plan(64, prompt_len=32))))
    long = len(pickle.dumps(execute_message(first_decode_plan(64, prompt_len=1024))))
    # 64 sequences x 1024 history tokens would be >= 128 kB; per sequence a decode step
    # carries ~10 ints plus its block-table row (1024 / 16 = 64 blocks here).
    assert long < 64 * (10 + 66) * 5 + 2048
    assert long - short < 64 * 64 * 5


def test_a_lora_request_crosses_as_its_adapter_only() -> None:
    config = SchedulerConfig(num_blocks=8, block_size=BLOCK, max_model_len=64, max_loras=1)
    scheduler = Scheduler(config)
    lora = LoRARequest("sql", 3, "/adapters/sql")
    scheduler.add(Sequence(0, [1, 2, 3], SamplingParams(temperature=0.7), lora=lora))
    scheduler.add(Sequence(1, [4, 5], SamplingParams(temperature=0.5)))
    plan = scheduler.schedule()
    assert plan is not None
    _, sent = execute_message(plan)
    assert [(r.seq_id, r.slot, r.lora, r.params) for r in sent.new_requests] == [
        (0, 0, lora, SamplingParams())
    ]
