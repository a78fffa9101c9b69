"""BatchPlan: the flat, varlen layout of one step, built from scheduled chunks."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from pagedinfer.domain import (
    BLOCK_TABLE_FILLER,
    PADDING_SLOT,
    NewRequest,
    SamplingParams,
    ScheduledChunk,
    Sequence,
    build_batch_plan,
    mixed_batch_plan,
)
from pagedinfer.domain.plan import needs_prompt_tokens


def make_seq(
    seq_id: int,
    num_tokens: int,
    block_table: list[int],
    *,
    computed: int = 0,
    prompt_len: int | None = None,
    params: SamplingParams | None = None,
) -> Sequence:
    tokens = [1000 * (seq_id + 1) + i for i in range(num_tokens)]
    prompt = tokens if prompt_len is None else tokens[:prompt_len]
    seq = Sequence(seq_id, prompt, params)
    seq.token_ids = tokens
    seq.block_table = list(block_table)
    seq.num_computed_tokens = computed
    seq.slot = seq_id + 3
    return seq


def test_prefill_of_two_fresh_sequences() -> None:
    # Block size 4. Sequence 0: 6 tokens in blocks [7, 2]; sequence 1: 3 tokens in block [5].
    a = make_seq(0, 6, [7, 2], params=SamplingParams(temperature=0.5, top_k=3, seed=11))
    b = make_seq(1, 3, [5], params=SamplingParams(top_p=0.9))
    plan = build_batch_plan(
        [ScheduledChunk(a, 6), ScheduledChunk(b, 3)], is_prefill=True, block_size=4
    )
    assert plan.is_prefill
    assert plan.seq_ids.tolist() == [0, 1]
    assert plan.query_lens.tolist() == [6, 3]
    assert plan.context_lens.tolist() == [6, 3]
    assert plan.input_ids.tolist() == a.token_ids + b.token_ids
    assert plan.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert plan.slot_mapping.tolist() == [28, 29, 30, 31, 8, 9, 20, 21, 22]
    assert plan.cu_seqlens_q.tolist() == [0, 6, 9]
    assert plan.cu_seqlens_k.tolist() == [0, 6, 9]
    assert plan.max_seqlen_q == 6
    assert plan.max_seqlen_k == 6
    assert plan.block_tables.tolist() == [7, 2, 5, BLOCK_TABLE_FILLER]  # [B, W] row-major
    assert [plan.block_table(0), plan.block_table(1)] == [[7, 2], [5, BLOCK_TABLE_FILLER]]
    assert plan.block_table_width == 2
    assert plan.block_size == 4
    assert plan.sample_indices.tolist() == [5, 8]
    assert plan.sampled_seq_ids == [0, 1]
    assert plan.sample_slots.tolist() == [a.slot, b.slot] == [3, 4]
    assert plan.new_requests == plan.released_slots == ()
    assert plan.num_seqs == 2
    assert plan.num_tokens == 9
    assert plan.num_samples == 2
    assert not plan.has_cached_prefix


def test_slots_follow_the_block_table_for_every_token() -> None:
    block_size = 3
    table = [9, 0, 4, 6]
    seq = make_seq(0, 11, table)
    plan = build_batch_plan([ScheduledChunk(seq, 11)], is_prefill=True, block_size=block_size)
    for position, slot in zip(plan.positions, plan.slot_mapping, strict=True):
        assert slot == table[position // block_size] * block_size + position % block_size
    assert PADDING_SLOT not in plan.slot_mapping


def test_a_chunk_that_stops_short_of_the_last_token_is_not_sampled() -> None:
    # Chunked prefill: sequence 0 computes tokens 4..7 of 10; sequence 1 finishes its prompt.
    a = make_seq(0, 10, [3, 1], computed=4)
    b = make_seq(1, 5, [0, 2], computed=2)
    plan = build_batch_plan(
        [ScheduledChunk(a, 4), ScheduledChunk(b, 3)], is_prefill=True, block_size=4
    )
    assert plan.positions.tolist() == [4, 5, 6, 7, 2, 3, 4]
    assert plan.input_ids.tolist() == a.token_ids[4:8] + b.token_ids[2:5]
    assert plan.slot_mapping.tolist() == [4, 5, 6, 7, 2, 3, 8]
    assert plan.query_lens.tolist() == [4, 3]
    assert plan.context_lens.tolist() == [8, 5]
    assert plan.cu_seqlens_q.tolist() == [0, 4, 7]
    assert plan.cu_seqlens_k.tolist() == [0, 8, 13]
    assert plan.max_seqlen_q == 4
    assert plan.max_seqlen_k == 8
    assert plan.sample_indices.tolist() == [6]
    assert plan.sampled_seq_ids == [1]
    assert plan.sample_slots.tolist() == [b.slot]
    assert plan.has_cached_prefix


def test_decode_plan_has_one_query_token_per_sequence() -> None:
    # Sequence 0: prompt 5, 2 completion tokens, 6 computed; its new token is position 6.
    a = make_seq(0, 7, [2, 8], computed=6, prompt_len=5)
    b = make_seq(1, 9, [1, 3, 0], computed=8, prompt_len=9)  # last prompt token left over
    plan = build_batch_plan(
        [ScheduledChunk(a, 1), ScheduledChunk(b, 1)], is_prefill=False, block_size=4
    )
    assert not plan.is_prefill
    assert plan.query_lens.tolist() == [1, 1]
    assert plan.input_ids.tolist() == [a.token_ids[6], b.token_ids[8]]
    assert plan.positions.tolist() == [6, 8]
    assert plan.slot_mapping.tolist() == [8 * 4 + 2, 0 * 4 + 0]
    assert plan.context_lens.tolist() == [7, 9]
    assert plan.cu_seqlens_q.tolist() == [0, 1, 2]
    assert plan.cu_seqlens_k.tolist() == [0, 7, 16]
    assert plan.block_tables.tolist() == [2, 8, BLOCK_TABLE_FILLER, 1, 3, 0]
    assert plan.block_table_width == 3
    assert plan.sample_indices.tolist() == [0, 1]
    assert plan.sampled_seq_ids == [0, 1]
    # The executor derives each sample's index in its request: position + 1 - prompt length.
    steps = [
        plan.positions[i] + 1 - seq.num_prompt_tokens for i, seq in zip([0, 1], [a, b], strict=True)
    ]
    assert steps == [a.num_completion_tokens, b.num_completion_tokens] == [2, 0]
    assert plan.has_cached_prefix


def test_block_tables_are_copies() -> None:
    seq = make_seq(0, 4, [3])
    plan = build_batch_plan([ScheduledChunk(seq, 4)], is_prefill=True, block_size=4)
    seq.block_table.append(6)
    assert plan.block_tables.tolist() == [3]


def test_a_chunk_one_token_short_of_the_end_is_not_sampled() -> None:
    seq = make_seq(0, 6, [1, 2])
    plan = build_batch_plan([ScheduledChunk(seq, 5)], is_prefill=True, block_size=4)
    assert plan.sample_indices.tolist() == [] and plan.sampled_seq_ids == []
    assert plan.sample_slots.tolist() == []


def test_filler_is_a_valid_block_id() -> None:
    # Kernels gather whole block-table rows; the filler must index a real block.
    assert BLOCK_TABLE_FILLER >= 0
    assert PADDING_SLOT < 0  # while a padding slot must never address one


def test_a_filler_table_entry_is_never_a_slot() -> None:
    # Padding entries keep gathers in bounds but are never written to.
    a = make_seq(0, 2, [5])
    b = make_seq(1, 9, [1, 2, 3])
    plan = build_batch_plan(
        [ScheduledChunk(a, 2), ScheduledChunk(b, 9)], is_prefill=True, block_size=4
    )
    assert plan.block_table(0) == [5, BLOCK_TABLE_FILLER, BLOCK_TABLE_FILLER]
    assert plan.slot_mapping[:2].tolist() == [20, 21]


def test_empty_plan() -> None:
    plan = build_batch_plan([], is_prefill=False, block_size=4)
    assert plan.num_seqs == plan.num_tokens == plan.num_samples == 0
    assert plan.cu_seqlens_q.tolist() == plan.cu_seqlens_k.tolist() == [0]
    assert plan.max_seqlen_q == plan.max_seqlen_k == 0
    assert plan.block_tables.tolist() == []
    assert plan.block_table_width == 0


def test_fields_are_flat_machine_integer_arrays() -> None:
    # The executor views them without a Python loop and packs them for one copy.
    a = make_seq(0, 6, [7, 2])
    plan = build_batch_plan([ScheduledChunk(a, 6)], is_prefill=True, block_size=4)
    int64 = ("seq_ids", "input_ids", "positions", "slot_mapping", "sample_indices")
    int32 = ("query_lens", "context_lens", "cu_seqlens_q", "cu_seqlens_k", "block_tables")
    for name in int64:
        assert getattr(plan, name).typecode == "q" and getattr(plan, name).itemsize == 8
    for name in (*int32, "sample_slots"):
        assert getattr(plan, name).typecode == "i" and getattr(plan, name).itemsize == 4


def test_a_plan_pickles_small() -> None:
    # Tensor-parallel workers receive every plan pickled.
    seqs = [make_seq(i, 200, list(range(i * 4, i * 4 + 4))) for i in range(16)]
    for seq in seqs:
        seq.num_computed_tokens = 199
    plan = build_batch_plan([ScheduledChunk(s, 1) for s in seqs], is_prefill=False, block_size=64)
    restored = pickle.loads(pickle.dumps(plan))
    assert restored == plan
    assert len(pickle.dumps(plan)) < 2_000


# ------------------------------------------------------------------------ prompt logprobs
LOGPROBS = SamplingParams(prompt_logprobs=2)


def test_prompt_logprob_rows_cover_each_chunk_up_to_the_last_prompt_token() -> None:
    other = make_seq(0, 3, [1])  # did not ask: no rows
    a = make_seq(1, 10, [2, 3, 4], params=LOGPROBS)
    plan = build_batch_plan(
        [ScheduledChunk(other, 3), ScheduledChunk(a, 4)], is_prefill=True, block_size=4
    )
    # Query tokens 3..6 (a's positions 0..3) each predict the prompt token after them.
    assert plan.prompt_logprob_rows == ((1, 3, 4),)
    assert plan.prompt_logprob_targets.tolist() == a.token_ids[1:5]
    a.num_computed_tokens = 4
    plan = build_batch_plan([ScheduledChunk(a, 6)], is_prefill=True, block_size=4)
    # Positions 4..8: the last prompt token (position 9) predicts no prompt token.
    assert plan.prompt_logprob_rows == ((1, 0, 5),)
    assert plan.prompt_logprob_targets.tolist() == a.token_ids[5:10]


def test_prompt_logprob_rows_stop_at_the_prompt_in_a_recomputation() -> None:
    # Preempted after 4 generated tokens: the recomputation covers prompt and completion,
    # but only the prompt's positions have prompt logprobs.
    b = make_seq(2, 12, [5, 6, 7], prompt_len=8, params=LOGPROBS)
    plan = build_batch_plan([ScheduledChunk(b, 12)], is_prefill=True, block_size=4)
    assert plan.prompt_logprob_rows == ((2, 0, 7),)
    assert plan.prompt_logprob_targets.tolist() == b.token_ids[1:8]
    # A chunk that starts at the last prompt token has none left to predict.
    c = make_seq(3, 12, [5, 6, 7], computed=7, prompt_len=8, params=LOGPROBS)
    plan = build_batch_plan([ScheduledChunk(c, 5)], is_prefill=True, block_size=4)
    assert plan.prompt_logprob_rows == ()
    assert plan.prompt_logprob_targets.tolist() == []


@pytest.mark.parametrize(
    ("params", "needed"),
    [
        (SamplingParams(), False),
        (SamplingParams(repetition_penalty=1.2), True),
        (SamplingParams(prompt_logprobs=0), True),
        (SamplingParams(repetition_penalty=0.8, prompt_logprobs=1), True),
        (SamplingParams(presence_penalty=0.5, logprobs=2), False),
    ],
)
def test_the_executor_needs_the_prompt_for_repetition_penalty_or_prompt_logprobs(
    params: SamplingParams, needed: bool
) -> None:
    assert needs_prompt_tokens(params) is needed


# ----------------------------------------------------------------------------- mixed steps
def mixed_parts(
    decode_tables: list[list[int]], chunk_tables: list[list[int]]
) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
    """Decode rows (one token each, every other token computed) and whole-prompt chunks."""
    decoders = []
    for i, table in enumerate(decode_tables):
        length = 4 * len(table) - 1 - i % 2
        decoders.append(ScheduledChunk(make_seq(i, length, table, computed=length - 1), 1))
    chunks = []
    for j, table in enumerate(chunk_tables):
        seq = make_seq(10 + j, 4 * len(table) - 2, table, computed=j)
        chunks.append(ScheduledChunk(seq, seq.num_tokens - seq.num_computed_tokens))
    return decoders, chunks


@pytest.mark.parametrize(
    ("decode_tables", "chunk_tables"),
    [
        ([[1], [2, 3], [4]], [[5, 6, 7], [8]]),  # the chunks' tables are wider
        ([[1, 2, 3, 9], [4]], [[5], [6, 7]]),  # the decode rows' tables are wider
        ([[1, 2]], [[3, 4]]),  # equal widths
    ],
)
def test_a_mixed_plan_is_the_decode_rows_then_the_chunks(
    decode_tables: list[list[int]], chunk_tables: list[list[int]]
) -> None:
    decoders, chunks = mixed_parts(decode_tables, chunk_tables)
    plan = mixed_batch_plan(
        build_batch_plan(decoders, is_prefill=False, block_size=4),
        build_batch_plan(chunks, is_prefill=True, block_size=4),
        released_slots=(5,),
    )
    # The same arrays as one plan over all rows, with the decode rows marked (what only
    # chunks carry for speculative decoding aside: decode rows are not chunks).
    expected = build_batch_plan([*decoders, *chunks], is_prefill=True, block_size=4)
    aside = ("released_slots", "num_decode_rows", "block_table_lens", "num_generation_tokens")
    for field in dataclasses.fields(plan):
        if field.name not in aside:
            assert getattr(plan, field.name) == getattr(expected, field.name), field.name
    assert plan.is_prefill and plan.is_mixed
    assert plan.num_decode_rows == len(decoders)
    assert plan.released_slots == (5,)
    assert plan.sample_indices[: len(decoders)].tolist() == list(range(len(decoders)))
    assert plan.sampled_seq_ids == [c.seq.seq_id for c in decoders] + [c.seq.seq_id for c in chunks]
    assert plan.block_table_width == max(map(len, decode_tables + chunk_tables))
    assert plan.has_cached_prefix


def test_a_mixed_plan_shifts_the_chunks_forks_and_prompt_logprob_rows() -> None:
    decoders, _ = mixed_parts([[1], [2, 3]], [])
    forked = make_seq(10, 6, [4, 5], params=LOGPROBS)
    forks = tuple(make_seq(20 + i, 6, [4, 6 + i]) for i in range(2))
    later = make_seq(11, 9, [8, 9, 10], computed=2, params=LOGPROBS)
    chunks = [ScheduledChunk(forked, 6, forks), ScheduledChunk(later, 7)]
    prefill = build_batch_plan(
        chunks, is_prefill=True, block_size=4, released_slots=(9,), block_copies=((4, 6),)
    )
    assert prefill.forks == ((1, 20), (2, 21))
    assert prefill.prompt_logprob_rows == ((10, 0, 5), (11, 6, 6))
    request = NewRequest(seq_id=11, slot=4, params=LOGPROBS, num_prompt_tokens=9)
    plan = mixed_batch_plan(
        build_batch_plan(decoders, is_prefill=False, block_size=4),
        prefill,
        released_slots=(5,),
        new_requests=(request,),
        block_copies=((5, 7),),
    )
    # Two decode rows (two tokens, two samples) come first.
    assert plan.forks == ((3, 20), (4, 21))
    assert plan.prompt_logprob_rows == ((10, 2, 5), (11, 8, 6))
    assert plan.prompt_logprob_targets == prefill.prompt_logprob_targets
    assert plan.sampled_seq_ids == [0, 1, 10, 20, 21, 11]
    # The step's own deltas and copies, not the parts'.
    assert (plan.released_slots, plan.new_requests) == ((5,), (request,))
    assert plan.block_copies == ((5, 7),)
    whole = build_batch_plan([*decoders, *chunks], is_prefill=True, block_size=4)
    assert (whole.forks, whole.prompt_logprob_rows) == (plan.forks, plan.prompt_logprob_rows)


def test_decode_and_prefill_plans_are_not_mixed() -> None:
    decoders, chunks = mixed_parts([[1], [2]], [[3]])
    decode = build_batch_plan(decoders, is_prefill=False, block_size=4)
    prefill = build_batch_plan(chunks, is_prefill=True, block_size=4)
    assert (decode.num_decode_rows, decode.is_mixed) == (2, False)
    assert (prefill.num_decode_rows, prefill.is_mixed) == (0, False)
    # A decode step built by hand without the count reports every row as a decode row.
    assert dataclasses.replace(decode, num_decode_rows=0).num_decode_rows == 2
