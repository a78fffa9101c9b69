"""``BatchPlan``: everything one model step must compute, as plain Python ints.

The scheduler decides *which* tokens of *which* sequences run; :func:`build_batch_plan`
writes that decision down in the flat, varlen form attention kernels want. The adapters
turn a plan into tensors in one place and never look at ``Sequence`` objects, so the same
plan can drive a torch runtime, a tensor-parallel worker (it pickles small) or a fake
executor in a test.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

from pagedinfer.domain.sequence import Sequence

__all__ = ["BLOCK_TABLE_FILLER", "PADDING_SLOT", "BatchPlan", "ScheduledChunk", "build_batch_plan"]

# Block-table entries past a sequence's last block. 0 keeps every gather in bounds; kernels
# never read those entries because they stop at the context length.
BLOCK_TABLE_FILLER = 0
# Slot of a token whose K/V must not be stored (CUDA-graph padding rows).
PADDING_SLOT = -1


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at ``seq.num_computed_tokens``."""

    seq: Sequence
    num_tokens: int


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """One step. Lists are per query token or per sequence as named; treat them as read-only.

    Query tokens of sequence ``i`` are ``input_ids[cu_seqlens_q[i]:cu_seqlens_q[i+1]]``; they
    attend causally to the first ``context_lens[i]`` tokens of that sequence, whose K/V live
    in the blocks ``block_tables[i]`` (after this step's tokens are stored at
    ``slot_mapping``). ``sample_indices`` are the query-token rows whose logits are sampled,
    one per entry of ``sampled_seq_ids`` and of the per-sample parameter lists.
    """

    is_prefill: bool
    seq_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    cu_seqlens_q: list[int]
    cu_seqlens_k: list[int]
    max_seqlen_q: int
    max_seqlen_k: int
    block_tables: list[list[int]]
    block_table_width: int
    block_size: int
    sample_indices: list[int]
    sampled_seq_ids: list[int]
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    seeds: list[int | None]
    # Completion tokens the sampled sequence already has: with ``seeds`` it keys a
    # reproducible draw that does not depend on what else is in the batch.
    sample_steps: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_samples(self) -> int:
        return len(self.sample_indices)

    @property
    def has_cached_prefix(self) -> bool:
        """True when some sequence attends to K/V computed in an earlier step."""
        return self.cu_seqlens_k[-1] > self.cu_seqlens_q[-1]


def build_batch_plan(
    chunks: SequenceABC[ScheduledChunk], *, is_prefill: bool, block_size: int
) -> BatchPlan:
    """Lay out the scheduled chunks. Blocks for every slot must already be in the tables."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_q = [0]
    cu_k = [0]
    query_lens: list[int] = []
    context_lens: list[int] = []
    tables: list[list[int]] = []
    sample_indices: list[int] = []
    sampled: list[Sequence] = []
    for chunk in chunks:
        seq = chunk.seq
        start = seq.num_computed_tokens
        end = start + chunk.num_tokens
        table = seq.block_table
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        _append_slots(slot_mapping, table, start, end, block_size)
        query_lens.append(chunk.num_tokens)
        context_lens.append(end)
        cu_q.append(cu_q[-1] + chunk.num_tokens)
        cu_k.append(cu_k[-1] + end)
        tables.append(table)
        if end == seq.num_tokens:  # the chunk reaches the last token: its logits are sampled
            sample_indices.append(cu_q[-1] - 1)
            sampled.append(seq)
    width = max((len(table) for table in tables), default=0)
    padded = [table + [BLOCK_TABLE_FILLER] * (width - len(table)) for table in tables]
    return BatchPlan(
        is_prefill=is_prefill,
        seq_ids=[chunk.seq.seq_id for chunk in chunks],
        query_lens=query_lens,
        context_lens=context_lens,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max(query_lens, default=0),
        max_seqlen_k=max(context_lens, default=0),
        block_tables=padded,
        block_table_width=width,
        block_size=block_size,
        sample_indices=sample_indices,
        sampled_seq_ids=[seq.seq_id for seq in sampled],
        temperatures=[float(seq.params.temperature) for seq in sampled],
        top_ks=[seq.params.top_k for seq in sampled],
        top_ps=[float(seq.params.top_p) for seq in sampled],
        seeds=[seq.params.seed for seq in sampled],
        sample_steps=[seq.num_completion_tokens for seq in sampled],
    )


def _append_slots(out: list[int], table: list[int], start: int, end: int, block_size: int) -> None:
    position = start
    while position < end:
        index, offset = divmod(position, block_size)
        run = min(block_size - offset, end - position)
        base = table[index] * block_size + offset
        out.extend(range(base, base + run))
        position += run
