"""``SamplingPipeline`` (``adapters/sampling/pipeline.py``): begin, sample, read, and the records
of the per-request state a step changes, undone when the scheduler drops the step."""

from __future__ import annotations

from array import array

import pytest
import torch

from pagedinfer.adapters.host_transfers import HostUploads, Readbacks
from pagedinfer.adapters.sampling.pipeline import SamplingPipeline
from pagedinfer.adapters.step_inputs import StepPacker
from pagedinfer.domain.plan import BatchPlan, NewRequest
from pagedinfer.domain.sampling import SamplingParams

CPU = torch.device("cpu")
VOCAB = 8
# Token 1 is the favourite, token 2 a close second.
LOGITS = [0.0, 1.0, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0]


def _pipeline() -> SamplingPipeline:
    return SamplingPipeline(
        max_running=4,
        vocab_size=VOCAB,
        eos_token_ids=(0,),
        device=CPU,
        seed=0,
        uploads=HostUploads(CPU),
        readbacks=Readbacks(CPU),
    )


def _plan(
    step_id: int,
    *,
    recorded: int = 0,
    params: SamplingParams | None = None,
) -> BatchPlan:
    """A decode step of one sequence at slot 0 (installed when ``params`` is given)."""
    new = () if params is None else (NewRequest(7, 0, params, 3),)
    return BatchPlan(
        is_prefill=False,
        block_size=16,
        seq_ids=array("q", [7]),
        query_lens=array("i", [1]),
        context_lens=array("i", [4]),
        cu_seqlens_q=array("i", [0, 1]),
        cu_seqlens_k=array("i", [0, 4]),
        max_seqlen_q=1,
        max_seqlen_k=4,
        block_tables=array("i", [0]),
        block_table_width=1,
        input_ids=array("q", [5]),
        positions=array("q", [3]),
        slot_mapping=array("q", [3]),
        sample_indices=array("q", [0]),
        sample_slots=array("i", [0]),
        new_requests=new,
        step_id=step_id,
        recorded_step_id=recorded,
    )


def _step(pipeline: SamplingPipeline, plan: BatchPlan) -> list[int]:
    """begin, pack (as the runner does), sample, read; the sampled tokens."""
    delta = pipeline.begin(plan)
    inputs = StepPacker(CPU, sampled=True, zero_copy=True).pack(plan, delta)
    if inputs.table_rows is not None:
        pipeline.table.write_rows(*inputs.table_rows)
    logits = torch.tensor([LOGITS])
    read = pipeline.sample(plan, logits, inputs.sample_slots, inputs.sample_positions)
    return read().token_ids


def test_greedy_sampling_with_logprobs() -> None:
    pipeline = _pipeline()
    plan = _plan(1, params=SamplingParams(temperature=0.0, logprobs=1))
    delta = pipeline.begin(plan)
    inputs = StepPacker(CPU, sampled=True, zero_copy=True).pack(plan, delta)
    assert inputs.table_rows is not None
    pipeline.table.write_rows(*inputs.table_rows)
    read = pipeline.sample(
        plan, torch.tensor([LOGITS]), inputs.sample_slots, inputs.sample_positions
    )
    sampled = read()
    assert sampled.token_ids == [1] and sampled.failed is None
    assert sampled.logprobs is not None
    (entry,) = sampled.logprobs
    assert entry is not None and entry.token_ids == [1, 1] and entry.rank == 1
    expected = torch.log_softmax(torch.tensor(LOGITS), 0)[1].item()
    assert entry.logprobs[0] == pytest.approx(expected, abs=1e-5)
    last = pipeline.last_sampled
    assert last is not None and last[0] == 1 and last[1].tolist() == [1]


PENALIZED = SamplingParams(temperature=0.0, presence_penalty=0.5)


def test_a_recorded_step_keeps_its_penalty() -> None:
    pipeline = _pipeline()
    assert _step(pipeline, _plan(1, params=PENALIZED)) == [1]
    # The scheduler recorded step 1: token 1 is penalized below token 2.
    assert _step(pipeline, _plan(2, recorded=1)) == [2]


def test_a_dropped_step_is_undone_before_the_next() -> None:
    pipeline = _pipeline()
    assert _step(pipeline, _plan(1, params=PENALIZED)) == [1]
    # Step 1 was dropped (recorded_step_id stays 0): its token does not count.
    assert _step(pipeline, _plan(2, recorded=0)) == [1]


def test_reset_forgets_every_request() -> None:
    pipeline = _pipeline()
    _step(pipeline, _plan(1, params=SamplingParams(temperature=0.0)))
    pipeline.reset()
    assert pipeline.begin(_plan(2)) is None  # nothing to release or install
    assert pipeline.grammar_step(_plan(2)) is None
