"""The step packer: a plan becomes device tensors through one packed buffer and one copy.

On the CPU the packer can run both ways: zero-copy (the production CPU path: views of the
plan's arrays) and copying (what CUDA does: pack, one copy, views of the device buffer, with
"device" memory being host memory here). The runner-level tests count the copies per step and
forbid ``torch.tensor`` inside ``execute``.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer.adapters import step_inputs
from pagedinfer.adapters.sampling.table import SamplingTable
from pagedinfer.adapters.step_inputs import StepPacker
from pagedinfer.domain import BatchPlan, SamplingParams, Scheduler, SchedulerConfig, Sequence

from .runner_helpers import make_runner, random_prompts
from .test_cuda_graph_logic import install_stand_in

CPU = torch.device("cpu")


def scheduled_plans() -> tuple[BatchPlan, BatchPlan, BatchPlan]:
    """A chunked prefill step (a partial chunk and a sampled one), the prefill step that
    finishes the long prompt, then a decode step, from the domain Scheduler."""
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=32, block_size=16, max_num_batched_tokens=40, max_model_len=96)
    )
    params = SamplingParams(temperature=0.8, top_k=7, seed=5, max_tokens=4, ignore_eos=True)
    scheduler.add(Sequence(0, list(range(1, 21)), params))
    scheduler.add(Sequence(1, list(range(30, 60)), SamplingParams(max_tokens=4)))
    first = scheduler.schedule()
    assert first is not None and first.is_prefill
    scheduler.postprocess(first, [9] * first.num_samples)
    second = scheduler.schedule()
    assert second is not None and second.is_prefill
    scheduler.postprocess(second, [9] * second.num_samples)
    decode = scheduler.schedule()
    assert decode is not None and not decode.is_prefill
    return first, second, decode


def assert_matches_plan(inputs: step_inputs.StepInputs, plan: BatchPlan) -> None:
    meta = inputs.meta
    assert inputs.input_ids.tolist() == plan.input_ids.tolist()
    assert inputs.positions.tolist() == plan.positions.tolist()
    assert meta.slot_mapping.tolist() == plan.slot_mapping.tolist()
    assert meta.context_lens.tolist() == plan.context_lens.tolist()
    assert meta.cu_seqlens_q.tolist() == plan.cu_seqlens_q.tolist()
    assert meta.cu_seqlens_k.tolist() == plan.cu_seqlens_k.tolist()
    assert meta.block_tables.flatten().tolist() == plan.block_tables.tolist()
    assert meta.block_tables.shape == (plan.num_seqs, plan.block_table_width)
    assert inputs.sample_slots.tolist() == plan.sample_slots.tolist()
    assert inputs.input_ids.dtype == inputs.positions.dtype == meta.slot_mapping.dtype
    assert meta.block_tables.dtype == meta.context_lens.dtype == torch.int32
    if plan.num_samples == plan.num_tokens:
        assert inputs.sample_indices is None
    else:
        assert inputs.sample_indices is not None
        assert inputs.sample_indices.tolist() == plan.sample_indices.tolist()
    positions = [plan.positions[index] for index in plan.sample_indices]
    assert inputs.sample_positions().tolist() == positions


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "packed"])
def test_packed_steps_hold_the_plan(zero_copy: bool) -> None:
    packer = StepPacker(CPU, sampled=True, zero_copy=zero_copy)
    table = SamplingTable(8, vocab_size=100, device=CPU)
    for plan in scheduled_plans():
        delta = table.apply(plan.released_slots, plan.new_requests)
        inputs = packer.pack(plan, delta)
        assert_matches_plan(inputs, plan)
        if delta is None:
            assert inputs.table_rows is None
        else:
            assert inputs.table_rows is not None
            slots, floats, ints = inputs.table_rows
            assert slots.tolist() == delta.slots.tolist()
            assert floats.tolist() == pytest.approx(delta.floats.tolist())
            assert ints.tolist() == delta.ints.tolist()
            table.write_rows(slots, floats, ints)
    assert len(table) == 2


def test_zero_copy_tensors_view_the_plan_arrays() -> None:
    plan = scheduled_plans()[0]
    inputs = StepPacker(CPU, sampled=True, zero_copy=True).pack(plan)
    assert inputs.input_ids.data_ptr() == plan.input_ids.buffer_info()[0]
    assert inputs.meta.block_tables.data_ptr() == plan.block_tables.buffer_info()[0]


def test_packed_fields_start_aligned_and_share_one_buffer() -> None:
    plan = scheduled_plans()[0]
    inputs = StepPacker(CPU, sampled=True, zero_copy=False).pack(plan)
    tensors = [
        inputs.input_ids,
        inputs.positions,
        inputs.meta.slot_mapping,
        inputs.meta.context_lens,
        inputs.meta.cu_seqlens_q,
        inputs.meta.cu_seqlens_k,
        inputs.meta.block_tables,
        inputs.sample_slots,
    ]
    base = tensors[0].untyped_storage().data_ptr()
    for tensor in tensors:
        assert tensor.untyped_storage().data_ptr() == base  # one buffer, one copy
        assert (tensor.data_ptr() - base) % step_inputs.ALIGNMENT == 0


def test_layout_offsets_are_aligned() -> None:
    layout, nbytes = step_inputs.pack_layout(
        [
            ("a", torch.int64, 3),
            ("b", torch.int32, 5),
            ("c", torch.float32, 0),
            ("d", torch.int64, 1),
        ]
    )
    assert [field.offset for field in layout.values()] == [0, 64, 128, 128]
    assert nbytes == 192


def test_host_buffers_alternate_and_grow() -> None:
    staging = step_inputs._HostStaging(CPU, 64)
    first, small = staging.acquire(64)
    second, _ = staging.acquire(64)
    third, big = staging.acquire(1000)
    assert (first, second, third) == (0, 1, 0)
    assert big.numel() >= 1000 and big.data_ptr() != small.data_ptr()


def test_copies_follow_a_new_target_and_a_grown_buffer() -> None:
    """The copy's slices are kept by size: a new target, or a host buffer that grew, must
    not be served by the slices of the old one."""
    staging = step_inputs._HostStaging(CPU, 128)
    first, second = torch.zeros(128, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
    index, host = staging.acquire(128)
    host.fill_(7)
    staging.copy(index, first, 128)
    host.fill_(9)
    staging.copy(index, second, 128)
    assert set(first.tolist()) == {7} and set(second[:128].tolist()) == {9}
    staging.acquire(128)
    grown_index, grown = staging.acquire(1000)
    assert grown_index == index and grown.data_ptr() != host.data_ptr()
    grown.fill_(5)
    staging.copy(index, second, 128)
    assert set(second[:128].tolist()) == {5} and set(second[128:].tolist()) == {0}


def test_a_step_without_samples_or_slots(tiny_checkpoint: Path) -> None:
    """A worker rank (no sampling) and a plan with no block tables (width 0)."""
    plan = BatchPlan(
        is_prefill=True,
        block_size=16,
        seq_ids=array("q", [0]),
        query_lens=array("i", [2]),
        context_lens=array("i", [2]),
        cu_seqlens_q=array("i", [0, 2]),
        cu_seqlens_k=array("i", [0, 2]),
        max_seqlen_q=2,
        max_seqlen_k=2,
        block_tables=array("i"),
        block_table_width=0,
        input_ids=array("q", [5, 6]),
        positions=array("q", [0, 1]),
        slot_mapping=array("q", [-1, -1]),
        sample_indices=array("q"),
        sample_slots=array("i"),
    )
    for zero_copy in (True, False):
        inputs = StepPacker(CPU, sampled=False, zero_copy=zero_copy).pack(plan)
        assert inputs.meta.block_tables.shape == (1, 1)
        assert inputs.sample_slots.numel() == 0 and inputs.sample_indices is not None
        assert inputs.meta.has_padding_slots


# ------------------------------------------------------------- one copy per step, no lists


def test_every_step_is_one_copy_and_no_list_becomes_a_tensor(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drive a runner (copying packer, graph stand-in) through prefill, decode replays and
    eager decode: each step copies to the "device" exactly once, and nothing in ``execute``
    calls ``torch.tensor`` on a list."""
    runner = make_runner(tiny_checkpoint, block_size=16, num_kv_blocks=64, max_model_len=64)
    graphs = install_stand_in(runner, max_num_seqs=2)  # 3 sequences decode eagerly
    copies: list[int] = []
    original_copy = step_inputs._HostStaging.copy

    def counting_copy(self: Any, index: int, target: torch.Tensor, nbytes: int) -> None:
        copies.append(nbytes)
        original_copy(self, index, target, nbytes)

    def forbidden(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("torch.tensor called in the step loop")

    monkeypatch.setattr(step_inputs._HostStaging, "copy", counting_copy)
    scheduler = Scheduler(SchedulerConfig(num_blocks=64, block_size=16, max_model_len=64))
    params = [
        SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True) for i in range(2)
    ] + [SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True)]
    for index, prompt in enumerate(random_prompts(seed=4, count=3, lengths=(4, 30))):
        scheduler.add(Sequence(index, prompt, params[index]))
    steps = 0
    with monkeypatch.context() as inner:
        inner.setattr(torch, "tensor", forbidden)
        while (plan := scheduler.schedule()) is not None:
            before = len(copies)
            scheduler.postprocess(plan, runner.execute(plan).sampled_token_ids)
            assert len(copies) - before == 1, plan
            steps += 1
    assert steps > 5 and graphs.num_replays > 0
    assert graphs.num_replays < steps  # some decode steps (3 sequences) ran eagerly
