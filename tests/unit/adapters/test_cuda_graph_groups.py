"""CUDA-graph decode with KV groups (hybrid attention), on the CPU: the static inputs hold a
block table and a slot mapping per group, the packer writes every group's rows (padding rows
store nothing in any group), each layer's graph metadata is its group's, and the engine decodes
a tiny Gemma 3 (two sliding layers, one full: three groups) through the stand-in graphs of
``test_cuda_graph_logic`` token for token as transformers does.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hf_reference import hf_greedy
from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.cuda_graph import (
    DecodeGraphLayout,
    graph_metadata,
    reads_device_values_on_host,
)
from pagedinfer.adapters.model_runner import ModelRunner
from pagedinfer.adapters.step_inputs import GraphInputs, StepPacker
from pagedinfer.domain import BatchPlan, Scheduler, SchedulerConfig, Sequence
from pagedinfer.domain.plan import PADDING_SLOT

from .runner_helpers import make_runner, random_prompts
from .test_cuda_graph_logic import GREEDY, decode_plan, install_stand_in

CPU = torch.device("cpu")
VOCAB = 256


def grouped_plan(num_seqs: int, width: int, num_groups: int, *, seed: int) -> BatchPlan:
    """:func:`decode_plan` with tables and slots of its own for KV groups 1.. (random)."""
    plan = decode_plan(num_seqs, width, seed=seed)
    generator = torch.Generator().manual_seed(seed + 100)
    tables = [
        array("i", torch.randint(1, 1000, (num_seqs * width,), generator=generator).tolist())
        for _ in range(1, num_groups)
    ]
    slots = [
        array("q", torch.randint(0, 16000, (num_seqs,), generator=generator).tolist())
        for _ in range(1, num_groups)
    ]
    return replace(plan, group_block_tables=tuple(tables), group_slot_mappings=tuple(slots))


def grouped_packer(rows: int, width: int, num_groups: int) -> tuple[StepPacker, GraphInputs]:
    packer = StepPacker(CPU, sampled=True, zero_copy=False)
    return packer, packer.attach_graph_inputs(rows, width, rows, num_groups=num_groups)


def group_tables(static: GraphInputs) -> list[torch.Tensor]:
    return [static.block_tables, *static.group_block_tables]


def group_slots(static: GraphInputs) -> list[torch.Tensor]:
    return [static.slot_mapping, *static.group_slot_mappings]


@pytest.mark.parametrize("width", [5, 16])  # 64-byte rows, or padded to them
def test_fresh_grouped_inputs_are_padding_in_every_group(width: int) -> None:
    _, static = grouped_packer(12, width, num_groups=3)
    assert static.num_groups == 3
    for table in group_tables(static):
        assert table.shape == (12, width)  # every group as wide as the captured tables
        assert table.stride(1) == 1
    for slots in group_slots(static):
        assert slots.tolist() == [PADDING_SLOT] * 12
    # Every group's table and slots start 64-byte aligned (Triton specializes on it).
    base = static.input_ids.data_ptr()
    for tensor in (*group_tables(static), *group_slots(static)):
        assert (tensor.data_ptr() - base) % 64 == 0


@pytest.mark.parametrize("width", [3, 10])  # narrower than the captured tables, and as wide
def test_each_group_replays_what_the_eager_step_reads(width: int) -> None:
    """The graph metadata each layer reads (``for_group``) equals the eager step's, per
    group, on the step's rows; padding rows store nothing in any group; only the step's rows
    and columns of the tables are copied (stale ones are never read)."""
    layout = DecodeGraphLayout.for_limits(
        max_num_seqs=20, max_model_len=160, block_size=16, num_groups=3
    )
    assert layout.table_width == 10
    packer, static = grouped_packer(layout.largest, layout.table_width, num_groups=3)
    packer.pack_graph_decode(grouped_plan(20, 10, 3, seed=0), bucket=20)  # stale values
    before = [table.clone() for table in group_tables(static)]
    plan = grouped_plan(3, width, 3, seed=1)
    assert layout.covers(plan)

    region = packer._graph
    assert region is not None
    copied: list[int] = []
    copy = region.staging.copy

    def counted(index: int, target: torch.Tensor, nbytes: int) -> None:
        copied.append(nbytes)
        copy(index, target, nbytes)

    region.staging.copy = counted  # type: ignore[method-assign]

    inputs = packer.pack_graph_decode(plan, bucket=4)

    # The step's tables travel compact: its rows and columns of each group, not the bucket's
    # full-width rows (the transfer does not grow with max_model_len times the groups).
    staging = region.layout["group_tables_staging"].offset
    assert copied == [staging + 3 * 3 * width * 4]
    eager = StepPacker(CPU, sampled=True, zero_copy=True).pack(plan).meta
    graph = graph_metadata(static, 4, 16)
    for group in range(3):
        replayed, expected = graph.for_group(group), eager.for_group(group)
        assert torch.equal(replayed.block_tables[:3, :width], expected.block_tables)
        assert torch.equal(replayed.slot_mapping[:3], expected.slot_mapping)
        assert replayed.slot_mapping[3] == PADDING_SLOT  # the bucket's padding row
        assert replayed.block_tables.shape == (4, layout.table_width)
        # The step's own tensors (what a draft model reads) are the same views.
        step = inputs.meta.for_group(group)
        assert step.block_tables.data_ptr() == replayed.block_tables.data_ptr()
        assert torch.equal(step.slot_mapping, expected.slot_mapping)
        assert torch.equal(group_tables(static)[group][3:], before[group][3:])  # not copied
        assert torch.equal(group_tables(static)[group][:3, width:], before[group][:3, width:])
    assert graph.context_lens.tolist() == [*plan.context_lens.tolist(), 0]


def test_a_plan_without_a_table_per_captured_group_runs_eagerly() -> None:
    layout = DecodeGraphLayout.for_limits(
        max_num_seqs=4, max_model_len=64, block_size=16, num_groups=2
    )
    assert layout.covers(grouped_plan(2, 2, 2, seed=3))
    assert not layout.covers(decode_plan(2, 2, seed=3))  # one table
    assert not layout.covers(grouped_plan(2, 2, 3, seed=3))  # three
    assert not DecodeGraphLayout.for_limits(max_num_seqs=4, max_model_len=64, block_size=16).covers(
        grouped_plan(2, 2, 2, seed=3)
    )


# ------------------------------------------------------------- a hybrid model, end to end


@pytest.fixture(scope="module")
def gemma3_checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    """Gemma 3: two sliding layers (window 8) to one full layer, hidden 64, vocab 256."""
    return make_checkpoint(
        "tiny",
        architecture="Gemma3ForCausalLM",
        num_hidden_layers=3,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        sliding_window=8,
        query_pre_attn_scalar=24,
        tie_word_embeddings=False,
        vocab_size=VOCAB,
    )


def _runner_of(engine: Engine) -> ModelRunner:
    executor = engine._executor
    assert isinstance(executor, ModelRunner)
    return executor


def test_engine_decodes_a_hybrid_model_through_the_graph_runner(gemma3_checkpoint: Path) -> None:
    prompts = random_prompts(seed=4, count=5, lengths=(3, 40), vocab=VOCAB)
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(5)
    ]
    with Engine(
        gemma3_checkpoint, device="cpu", kv_block_size=16, max_model_len=96, max_num_seqs=8
    ) as engine:
        runner = _runner_of(engine)
        assert [g.window for g in runner.kv_groups] == [None, 8, 8]
        graphs = install_stand_in(runner, max_num_seqs=8)
        assert graphs.layout.num_groups == 3 and graphs.static.num_groups == 3
        outputs = engine.generate(prompts, params, use_tqdm=False)
        decode_steps = engine.scheduler.stats().num_decode_steps
    for prompt, p, output in zip(prompts, params, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(gemma3_checkpoint, prompt, p.max_tokens)
    # Past the window (8 tokens), the sliding groups' tables hold null entries.
    assert decode_steps > 0 and graphs.num_replays == decode_steps


def test_padding_rows_store_nothing_in_any_group(gemma3_checkpoint: Path) -> None:
    """A replay of 3 sequences in bucket 4 changes the cache at exactly their slots of every
    group, although row 3 holds the inputs of an aborted sequence (in every group)."""
    runner = make_runner(gemma3_checkpoint, num_kv_blocks=48, max_model_len=64)
    assert len(runner.kv_groups) == 3
    graphs = install_stand_in(runner, max_num_seqs=4)
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=48, block_size=16, max_model_len=64, kv_groups=runner.kv_groups)
    )
    for index, prompt in enumerate(random_prompts(seed=9, count=4, lengths=(5, 30), vocab=VOCAB)):
        scheduler.add(Sequence(index, prompt, GREEDY))
    while (plan := scheduler.schedule()) is not None and plan.is_prefill:
        scheduler.postprocess(plan, runner.execute(plan).sampled_token_ids)
    assert plan is not None and plan.num_seqs == 4 and len(plan.group_block_tables) == 2
    scheduler.postprocess(plan, runner.execute(plan).sampled_token_ids)
    assert scheduler.abort(3)
    before = runner.kv_cache.clone()
    step = scheduler.schedule()
    assert step is not None and step.num_seqs == 3 and not step.is_prefill

    runner.execute(step)

    changed = (runner.kv_cache != before).flatten(2, 3).flatten(3).any(-1).any(1).any(0)
    written = {slot for slots in (step.slot_mapping, *step.group_slot_mappings) for slot in slots}
    assert len(written) == 9  # three sequences, three groups: blocks of their own
    assert changed.nonzero().flatten().tolist() == sorted(written)
    assert graphs.num_replays == 2


def test_only_models_that_read_device_values_on_the_host_stay_eager(
    make_checkpoint: Callable[..., Path], gemma3_checkpoint: Path
) -> None:
    """GPT-OSS's experts on the torch path count their tokens on the host (not capturable);
    its fused path (Triton) and Gemma 3 read nothing on the host."""
    gpt_oss = make_checkpoint(
        "tiny",
        architecture="GptOssForCausalLM",
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        vocab_size=VOCAB,
    )
    assert reads_device_values_on_host(make_runner(gpt_oss, attention_backend="torch").model)
    assert not reads_device_values_on_host(make_runner(gpt_oss, attention_backend="triton").model)
    assert not reads_device_values_on_host(make_runner(gemma3_checkpoint).model)


def test_graphs_captured_again_read_the_same_static_inputs() -> None:
    """Sleep mode's wake-up captures the graphs again: they get the inputs already there."""
    packer, static = grouped_packer(8, 4, num_groups=2)
    again = packer.attach_graph_inputs(8, 4, 8, num_groups=2)
    assert again is static
