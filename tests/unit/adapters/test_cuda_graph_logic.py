"""The CPU-testable half of CUDA-graph decode: buckets, which steps replay, how the step
packer writes a step into the static inputs (padding rows, narrow block tables), and the
whole replay path driven by the Engine with an eager stand-in for the captured graphs.

The stand-in re-runs the model over the static buffers on ``replay()``, which is what a
captured graph does; only the capture itself needs a GPU (``tests/gpu/test_cuda_graph.py``).
The warm-up pass that sizes the CUDA KV cache is checked here too, on a one-block cache.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hf_reference import hf_greedy
from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.cuda_graph import (
    MAX_GRAPH_BATCH_SIZE,
    CudaGraphDecodeRunner,
    DecodeGraphLayout,
    Replayable,
    decode_graph_buckets,
    graph_metadata,
)
from pagedinfer.adapters.kv_sizing import warm_up_plan
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.adapters.models.base import CausalLM
from pagedinfer.adapters.step_inputs import GraphInputs, StepPacker
from pagedinfer.domain import BatchPlan, Scheduler, SchedulerConfig, Sequence
from pagedinfer.domain.plan import PADDING_SLOT
from pagedinfer.errors import ConfigurationError

from .runner_helpers import make_runner, random_prompts

CPU = torch.device("cpu")

# ------------------------------------------------------------------------------- buckets


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (16, [1, 2, 4, 8, 16]),
        (17, [1, 2, 4, 8, 16, 17]),
        (100, [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]),
        (512, [1, 2, 4, 8, *range(16, 513, 16)]),
        (600, [1, 2, 4, 8, *range(16, 513, 16)]),
    ],
)
def test_buckets(max_num_seqs: int, expected: list[int]) -> None:
    assert decode_graph_buckets(max_num_seqs) == expected


def test_every_batch_up_to_the_cap_has_a_bucket() -> None:
    for max_num_seqs in range(1, 700):
        buckets = decode_graph_buckets(max_num_seqs)
        largest = min(max_num_seqs, MAX_GRAPH_BATCH_SIZE)
        assert buckets[-1] == largest
        assert buckets == sorted(set(buckets))
        layout = DecodeGraphLayout(tuple(buckets), table_width=1, block_size=16)
        for batch in range(1, largest + 1):
            bucket = layout.bucket_for(batch)
            assert bucket is not None and batch <= bucket
            # The smallest such bucket: at most doubling (small sizes) or 15 padding rows.
            assert bucket - batch < max(batch, 16)
        assert layout.bucket_for(largest + 1) is None


def test_no_buckets_for_a_non_positive_limit() -> None:
    with pytest.raises(ConfigurationError, match="max_num_seqs=0"):
        decode_graph_buckets(0)


def test_table_width_covers_max_model_len() -> None:
    assert (
        DecodeGraphLayout.for_limits(max_num_seqs=8, max_model_len=4096, block_size=256).table_width
        == 16
    )
    assert (
        DecodeGraphLayout.for_limits(max_num_seqs=8, max_model_len=100, block_size=16).table_width
        == 7
    )  # 100 tokens need a 7th, partial block


# ------------------------------------------------------------------- which steps replay

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _plans(num_seqs: int, prompt_len: int, *, block_size: int = 16) -> tuple[BatchPlan, BatchPlan]:
    """A real prefill plan and the decode plan that follows it, from the domain Scheduler."""
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=256, block_size=block_size, max_num_seqs=64, max_model_len=256)
    )
    for index in range(num_seqs):
        scheduler.add(Sequence(index, [1 + index] * prompt_len, GREEDY))
    prefill = scheduler.schedule()
    assert prefill is not None and prefill.is_prefill
    scheduler.postprocess(prefill, [5] * prefill.num_samples)
    decode = scheduler.schedule()
    assert decode is not None and not decode.is_prefill
    return prefill, decode


def test_decode_steps_within_the_largest_bucket_replay() -> None:
    layout = DecodeGraphLayout.for_limits(max_num_seqs=20, max_model_len=256, block_size=16)
    for num_seqs in (1, 3, 17, 20):
        prefill, decode = _plans(num_seqs, prompt_len=40)
        assert layout.covers(decode)
        assert not layout.covers(prefill)  # prefill steps always run eagerly
    _, too_many = _plans(21, prompt_len=4)
    assert not layout.covers(too_many)


def test_mixed_steps_never_replay() -> None:
    # Decode rows and a prefill chunk in one step run eagerly, however few rows they hold.
    layout = DecodeGraphLayout.for_limits(max_num_seqs=20, max_model_len=256, block_size=16)
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=256, block_size=16, max_num_seqs=64, max_model_len=256)
    )
    scheduler.add(Sequence(0, [1, 2, 3], GREEDY))
    first = scheduler.schedule()
    assert first is not None
    scheduler.postprocess(first, [5])
    scheduler.add(Sequence(1, [4], GREEDY))  # one token: the mixed step has two tokens
    mixed = scheduler.schedule()
    assert mixed is not None and mixed.is_mixed and mixed.num_tokens == 2
    assert not layout.covers(mixed)


def test_a_step_wider_than_the_captured_tables_runs_eagerly() -> None:
    _, decode = _plans(2, prompt_len=100)  # 101 tokens: 7 blocks of 16
    assert not DecodeGraphLayout.for_limits(max_num_seqs=4, max_model_len=96, block_size=16).covers(
        decode
    )
    assert DecodeGraphLayout.for_limits(max_num_seqs=4, max_model_len=112, block_size=16).covers(
        decode
    )


# -------------------------------------------------------------------- static inputs


def decode_plan(num_seqs: int, width: int, *, seed: int, block_size: int = 16) -> BatchPlan:
    """A decode plan of random but consistent rows (one query token per sequence)."""
    generator = torch.Generator().manual_seed(seed)
    context_lens = torch.randint(1, width * block_size + 1, (num_seqs,), generator=generator)
    tables = torch.randint(1, 1000, (num_seqs, width), generator=generator, dtype=torch.int32)
    cu_k = [0, *context_lens.cumsum(0).tolist()]
    return BatchPlan(
        is_prefill=False,
        block_size=block_size,
        seq_ids=array("q", range(num_seqs)),
        query_lens=array("i", [1] * num_seqs),
        context_lens=array("i", context_lens.tolist()),
        cu_seqlens_q=array("i", range(num_seqs + 1)),
        cu_seqlens_k=array("i", cu_k),
        max_seqlen_q=1,
        max_seqlen_k=int(context_lens.max()),
        block_tables=array("i", tables.flatten().tolist()),
        block_table_width=width,
        input_ids=array("q", torch.randint(0, 512, (num_seqs,), generator=generator).tolist()),
        positions=array("q", (context_lens - 1).tolist()),
        slot_mapping=array("q", torch.randint(0, 16000, (num_seqs,), generator=generator).tolist()),
        sample_indices=array("q", range(num_seqs)),
        sample_slots=array("i", range(num_seqs)),
    )


def graph_packer(rows: int, table_width: int) -> tuple[StepPacker, GraphInputs]:
    """A packer that copies (as on CUDA), with the static inputs of the graphs attached."""
    packer = StepPacker(CPU, sampled=True, zero_copy=False)
    return packer, packer.attach_graph_inputs(rows, table_width, num_slots=rows)


def test_packing_a_step_pads_the_bucket_and_fills_left_columns() -> None:
    layout = DecodeGraphLayout.for_limits(max_num_seqs=20, max_model_len=160, block_size=16)
    assert layout.table_width == 10
    packer, static = graph_packer(layout.largest, layout.table_width)
    # A full, wide step first, so that the next one lands on stale values.
    packer.pack_graph_decode(decode_plan(20, 10, seed=0), bucket=20)
    before = static.block_tables.clone()
    plan = decode_plan(3, 4, seed=1)

    inputs = packer.pack_graph_decode(plan, bucket=4)

    assert inputs.graph_batch == 4
    assert static.input_ids[:3].tolist() == plan.input_ids.tolist()
    assert static.positions[:3].tolist() == plan.positions.tolist()
    assert static.slot_mapping[:3].tolist() == plan.slot_mapping.tolist()
    assert static.context_lens[:3].tolist() == plan.context_lens.tolist()
    assert static.block_tables[:3, :4].flatten().tolist() == plan.block_tables.tolist()
    assert static.cu_seqlens_k[:4].tolist() == plan.cu_seqlens_k.tolist()
    # The padding row of bucket 4: nothing stored, no keys, an empty key range.
    assert static.slot_mapping[3] == PADDING_SLOT
    assert static.context_lens[3] == 0
    assert static.cu_seqlens_k[4] == static.cu_seqlens_k[3]
    # Table rows past the bucket are not even copied (kernels stop at context_len, and
    # the bucket's graph reads none of them).
    assert torch.equal(static.block_tables[4:], before[4:])
    # The step's tensors are the static inputs themselves, cut to its sequences.
    assert inputs.input_ids.data_ptr() == static.input_ids.data_ptr()
    assert inputs.sample_slots.tolist() == [0, 1, 2]


def test_fresh_static_inputs_are_all_padding() -> None:
    layout = DecodeGraphLayout.for_limits(max_num_seqs=12, max_model_len=64, block_size=16)
    _, static = graph_packer(layout.largest, layout.table_width)
    assert static.slot_mapping.tolist() == [PADDING_SLOT] * 12
    assert static.context_lens.tolist() == [0] * 12
    assert static.block_tables.shape == (12, 4)
    assert static.cu_seqlens_q.tolist() == list(range(13))


def test_bucket_metadata_views_the_static_inputs_and_has_no_host_values() -> None:
    layout = DecodeGraphLayout.for_limits(max_num_seqs=20, max_model_len=160, block_size=16)
    packer, static = graph_packer(layout.largest, layout.table_width)
    meta = graph_metadata(static, 8, layout.block_size)
    assert not meta.is_prefill
    assert meta.query_lens_host is None and meta.context_lens_host is None
    assert meta.num_seqs == 8
    assert meta.block_tables.shape == (8, layout.table_width)
    assert meta.cu_seqlens_q.shape == meta.cu_seqlens_k.shape == (9,)
    plan = decode_plan(5, 3, seed=2)
    packer.pack_graph_decode(plan, bucket=8)
    # What a graph captured over `meta` reads is what the packer wrote.
    assert meta.context_lens.tolist() == [*plan.context_lens.tolist(), 0, 0, 0]
    assert meta.context_lens.data_ptr() == static.context_lens.data_ptr()
    assert meta.block_tables.data_ptr() == static.block_tables.data_ptr()
    assert meta.slot_mapping.data_ptr() == static.slot_mapping.data_ptr()


def test_static_inputs_start_aligned() -> None:
    """Triton specializes on pointer alignment: every static tensor starts 64-byte aligned."""
    _, static = graph_packer(13, 7)
    base = static.input_ids.data_ptr()
    for tensor in (
        static.positions,
        static.slot_mapping,
        static.context_lens,
        static.cu_seqlens_q,
        static.cu_seqlens_k,
        static.block_tables,
    ):
        assert (tensor.data_ptr() - base) % 64 == 0


# ----------------------------------------------- the replay path with an eager stand-in


class EagerReplay:
    """Stands in for a captured graph: replay() re-runs the model over the static buffers."""

    def __init__(self, model: CausalLM, static: GraphInputs, batch: int, out: torch.Tensor) -> None:
        self.model, self.static, self.batch, self.out = model, static, batch, out

    def replay(self) -> None:
        static, batch = self.static, self.batch
        meta = graph_metadata(static, batch, 16)
        with torch.inference_mode():
            hidden = self.model(static.input_ids[:batch], static.positions[:batch], meta)
        self.out.copy_(hidden)


def install_stand_in(runner: ModelRunner, max_num_seqs: int) -> CudaGraphDecodeRunner:
    """Give a CPU runner a graph runner whose "graphs" are :class:`EagerReplay` s, and a
    packer that copies into their static inputs as on CUDA."""
    config = runner.config
    assert config.block_size == 16
    layout = DecodeGraphLayout.for_limits(
        max_num_seqs=max_num_seqs,
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        num_groups=max(len(runner.kv_groups), 1),  # KV groups: a table each
    )
    runner.packer = StepPacker(runner.device, sampled=True, zero_copy=False)
    static = runner.packer.attach_graph_inputs(
        layout.largest, layout.table_width, max_num_seqs, num_groups=layout.num_groups
    )
    hidden_size = runner.model_config.hidden_size
    outputs = {b: torch.full((b, hidden_size), float("nan")) for b in layout.buckets}
    graphs: dict[int, Replayable] = {
        b: EagerReplay(runner.model, static, b, outputs[b]) for b in layout.buckets
    }
    graph_runner = CudaGraphDecodeRunner(layout, static, graphs, outputs)
    runner.graph_runner = graph_runner
    return graph_runner


def _runner_of(engine: Engine) -> ModelRunner:
    executor = engine._executor
    assert isinstance(executor, ModelRunner)
    return executor


@pytest.mark.parametrize("num_prompts", [3, 17])
def test_engine_decodes_through_the_graph_runner(
    make_checkpoint: Callable[..., Path], num_prompts: int
) -> None:
    checkpoint = make_checkpoint("tiny")
    prompts = random_prompts(seed=num_prompts, count=num_prompts, lengths=(1, 40))
    # Different lengths: the batch shrinks step by step through buckets and between them.
    params = [
        SamplingParams(temperature=0.0, max_tokens=2 + i % 7, ignore_eos=True)
        for i in range(num_prompts)
    ]
    with Engine(
        checkpoint, device="cpu", kv_block_size=16, max_model_len=96, max_num_seqs=20
    ) as engine:
        graphs = install_stand_in(_runner_of(engine), max_num_seqs=20)
        outputs = engine.generate(prompts, params, use_tqdm=False)
        decode_steps = engine.scheduler.stats().num_decode_steps
    for prompt, p, output in zip(prompts, params, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(checkpoint, prompt, p.max_tokens)
    assert decode_steps > 0 and graphs.num_replays == decode_steps


def test_padding_rows_store_nothing(tiny_checkpoint: Path) -> None:
    """A replay of 3 sequences in bucket 4 changes the cache at exactly 3 slots, even though
    row 3 still holds the inputs of a sequence whose blocks were freed (and may be reused)."""
    runner = make_runner(tiny_checkpoint, block_size=16, num_kv_blocks=64, max_model_len=64)
    graphs = install_stand_in(runner, max_num_seqs=4)
    scheduler = Scheduler(SchedulerConfig(num_blocks=64, block_size=16, max_model_len=64))
    for index, prompt in enumerate(random_prompts(seed=9, count=4, lengths=(5, 30))):
        scheduler.add(Sequence(index, prompt, GREEDY))
    while (plan := scheduler.schedule()) is not None and plan.is_prefill:
        scheduler.postprocess(plan, runner.execute(plan).sampled_token_ids)
    assert plan is not None and plan.num_seqs == 4
    scheduler.postprocess(plan, runner.execute(plan).sampled_token_ids)  # bucket 4, every row real
    freed_slot = plan.slot_mapping[3]
    assert scheduler.abort(3)
    # Another sequence now owns that slot and has written it.
    flat = runner.kv_cache.flatten(2, 3)  # [2, layers, slots, kv_heads, head_dim]
    flat[:, :, freed_slot] = 7.0
    before = runner.kv_cache.clone()
    step = scheduler.schedule()
    assert step is not None and step.num_seqs == 3 and not step.is_prefill

    runner.execute(step)

    changed = (runner.kv_cache != before).flatten(2, 3).flatten(3).any(-1).any(1).any(0)
    assert changed.nonzero().flatten().tolist() == sorted(step.slot_mapping)
    assert bool((flat[:, :, freed_slot] == 7.0).all())
    assert graphs.num_replays == 2


def test_batches_above_the_largest_bucket_run_eagerly(make_checkpoint: Callable[..., Path]) -> None:
    checkpoint = make_checkpoint("tiny")
    prompts = random_prompts(seed=7, count=6, lengths=(3, 20))
    # Decode batches of 6, 5, 4, 3, 2, 1 sequences; graphs only up to 4.
    params = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True) for i in range(6)]
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64) as engine:
        graphs = install_stand_in(_runner_of(engine), max_num_seqs=4)
        outputs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, p, output in zip(prompts, params, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(checkpoint, prompt, p.max_tokens)
    assert graphs.num_replays == 4  # the steps with 4, 3, 2 and 1 sequences


def test_closed_graph_runner_replays_nothing() -> None:
    layout = DecodeGraphLayout.for_limits(max_num_seqs=4, max_model_len=64, block_size=16)
    _, static = graph_packer(layout.largest, layout.table_width)

    class Never:
        def replay(self) -> None:
            raise AssertionError("closed runners must not replay")

    graphs: dict[int, Replayable] = {b: Never() for b in layout.buckets}
    runner = CudaGraphDecodeRunner(
        layout, static, graphs, {b: torch.zeros(b, 8) for b in layout.buckets}
    )
    _, decode = _plans(2, prompt_len=5)
    assert runner.can_replay(decode) and runner.bucket_for(decode) == 2
    runner.close()
    runner.close()
    assert not runner.can_replay(decode) and runner.bucket_for(decode) is None


# ------------------------------------------------------- the warm-up that sizes the cache


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_warm_up_pass_runs_on_a_one_block_cache(tiny_checkpoint: Path, backend: str) -> None:
    """The CUDA sizing pass (a prefill of max_num_batched_tokens tokens over a one-block
    cache) is device-independent; here it runs on the CPU with each backend."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU run of the Triton kernels needs the interpreter")
    runner = make_runner(
        tiny_checkpoint,
        attention_backend=backend,
        max_model_len=80,
        max_num_batched_tokens=200,
        max_num_seqs=6,
    )
    plan = warm_up_plan(runner.config)
    assert plan.is_prefill and plan.num_tokens == 200
    assert plan.query_lens.tolist() == [80, 80, 40]  # max_model_len sequences, the last shorter
    assert plan.num_samples == 6
    assert set(plan.slot_mapping) == {PADDING_SLOT}  # nothing is stored
    # Every key a table-walking kernel reads maps to block 0, the only block there is.
    assert plan.block_table_width == 5 and set(plan.block_tables) == {0}
    assert len(plan.block_tables) == 3 * 5
    one_block = runner._allocate_kv_cache(1)
    runner._bind_kv_cache(one_block)
    sampled = runner.execute(plan).sampled_token_ids
    assert len(sampled) == 6
    assert torch.count_nonzero(one_block) == 0


def test_mixed_steps_run_eagerly_beside_graph_decode(make_checkpoint: Callable[..., Path]) -> None:
    """Requests arriving while others decode: mixed steps go through the packer's one-copy
    path and the eager model, pure decode steps through the (stand-in) graphs; tokens match
    transformers."""
    checkpoint = make_checkpoint("tiny")
    prompts = random_prompts(seed=5, count=6, lengths=(1, 40))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with Engine(
        checkpoint,
        device="cpu",
        kv_block_size=16,
        max_model_len=96,
        max_num_seqs=8,
        max_num_batched_tokens=24,
    ) as engine:
        graphs = install_stand_in(_runner_of(engine), max_num_seqs=8)
        ids = []
        finals = {}
        while len(finals) < len(prompts):
            if len(ids) < len(prompts):
                ids.append(engine.add_request(prompts[len(ids)], params))
            for output in engine.step():
                if output.finished:
                    finals[output.request_id] = output
        stats = engine.scheduler.stats()
    assert stats.num_mixed_steps > 0 and stats.num_decode_steps > 0
    assert graphs.num_replays == stats.num_decode_steps
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert finals[request_id].outputs[0].token_ids == hf_greedy(checkpoint, prompt, 6)
