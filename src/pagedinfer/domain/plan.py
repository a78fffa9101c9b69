"""``BatchPlan``: everything one model step must compute, in flat integer arrays.

The scheduler decides *which* tokens of *which* sequences run; a plan writes that decision
down in the flat, varlen form attention kernels want. The adapters turn a plan into tensors
in one place and never look at ``Sequence`` objects, so the same plan can drive a torch
runtime, a tensor-parallel worker (it pickles small) or a fake executor in a test.

The plan contract
-----------------
Every per-row or per-token field is an ``array.array`` of machine integers (typecode ``"q"``:
int64, ``"i"``: int32, native byte order), so an executor can view it without a Python-level
loop and without a copy (``torch.frombuffer(plan.positions, dtype=torch.int64)``, or with
NumPy ``np.frombuffer(plan.positions, dtype=plan.positions.typecode)``: NumPy reads the
typecode as the dtype) and pack every field of a step into one host buffer for one
host-to-device copy. Treat the arrays as read-only: a plan owns
them, and nothing in the scheduler touches them after :meth:`Scheduler.schedule` returns.

``B`` sequences (rows) run ``T`` query tokens; ``S`` of those tokens are sampled.

============================  =======  =========  =============================================
field                         type     length     meaning
============================  =======  =========  =============================================
``seq_ids``                   int64    B          the sequence (request) id of each row
``query_lens``                int32    B          query tokens of each row this step
``context_lens``              int32    B          tokens each row attends to, this step's included
``cu_seqlens_q``              int32    B + 1      prefix sums of ``query_lens`` (from 0)
``cu_seqlens_k``              int32    B + 1      prefix sums of ``context_lens`` (from 0)
``block_tables``              int32    B * W      row-major ``[B, W]``; ``W = block_table_width``
``input_ids``                 int64    T          token ids of the query tokens, row by row
``positions``                 int64    T          their positions in their sequences
``slot_mapping``              int64    T          the KV cache slot each token's K/V goes to
``sample_indices``            int64    S          query-token rows whose logits are sampled
``sample_slots``              int32    S          the sampling-table slot of each sampled row
``carried_rows``              int64    C          decode rows whose input is a pending token
``carried_samples``           int64    C          its sample index in the previous plan
============================  =======  =========  =============================================

Query tokens of row ``i`` are ``input_ids[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]``; they are the
last ``query_lens[i]`` of the first ``context_lens[i]`` tokens of that sequence and attend
causally to those, whose K/V live in the blocks ``block_tables[i * W:(i + 1) * W]`` (after this
step's tokens are stored at ``slot_mapping``; ``slot = block_id * block_size + offset``).
``W`` is the longest table in the step; shorter rows end in :data:`BLOCK_TABLE_FILLER`,
which kernels never read because they stop at the context length.

**Decode rows and prefill chunks.** The first ``D = num_decode_rows`` rows are *decode rows*:
sequences whose prompt is done, computing one token each (query length 1, their whole
history as context) and sampled in row order (``sample_indices[:D] == range(D)``). The
other rows are *prefill chunks* (any query length, a prompt or a recomputation after
preemption); a chunk is sampled only when it reaches the end of its sequence, at its last
query token. Three kinds of step follow:

* a *decode step*: ``is_prefill`` is False and every row is a decode row (``D == B``,
  ``query_lens == [1] * B``, ``cu_seqlens_q == range(B + 1)``); CUDA graphs replay these;
* a *prefill step*: ``is_prefill`` is True and ``D == 0``;
* a *mixed step* (``is_mixed``): ``is_prefill`` is True and ``0 < D < B``: decode rows first,
  then prefill chunks, under one token budget. Backends may attend over all rows with one
  varlen kernel (a decode row is a query of length 1 with a cached prefix) or split the step
  at row ``D`` (token ``D``) into a decode part and a prefill part.

``num_decode_rows`` may be left out (0) when building a decode step by hand: a plan with
``is_prefill=False`` always reports ``D == B``.

**Sampling travels as deltas** (the executor that samples keeps a persistent per-slot table
of sampling parameters). A *slot* is a small integer naming a request's row in that table,
stable from the request's first step until it finishes (preemption keeps it); slots are below
``min(max_num_seqs, max_num_batched_tokens)``. Each plan carries:

* ``released_slots``: slots whose request finished or was aborted; apply these first;
* ``new_requests``: :class:`NewRequest` s (slot, ``SamplingParams``, prompt length) to
  install, then.

Deltas are repeated in every plan until the scheduler has recorded a plan's results
(``postprocess``), so a plan that failed to run loses nothing; applying them is idempotent.
``step_id`` numbers the plans and ``recorded_step_id`` names the latest recorded one, for
executors whose state follows the sampled tokens (:mod:`pagedinfer.domain.executor`).

**Planned ahead** (:meth:`Scheduler.schedule_ahead`, async scheduling): a plan made while the
previous plan (``step_id - 1``) still runs, before its sampled tokens are known. A decode row
whose input is such a token carries :data:`PENDING_TOKEN` in ``input_ids``;
``carried_rows[i]`` names that row (its token index: decode rows come first, one token each)
and ``carried_samples[i]`` the sample of the previous plan whose token it is (an index into
that plan's ``sample_indices``). The executor writes those tokens into its inputs before the
forward, from where they already are (its device), so the host need not wait for them. Both
arrays are empty in a plan made by :meth:`Scheduler.schedule`.
Per step the plan carries only ``sample_slots`` for the sampled rows: the sample's index in
its request (the counter seeded sampling keys on) is ``positions[sample_indices[j]] + 1 -
num_prompt_tokens`` of its slot, which the executor derives.

**Several completions of one prompt** (``SamplingParams.n > 1``) share the prompt's KV. The
step that computes the prompt's last token samples its logits row once per completion:
``sample_indices`` then holds that row several times, each entry with its completion's own
slot, and ``forks`` names the sequence each extra entry belongs to. From then on every
completion is a sequence of its own whose block table starts with the prompt's full blocks
(shared); the prompt's partial last block is copied for each extra completion, on the device:
``block_copies`` lists ``(source block, destination block)`` pairs the executor copies (every
layer, K and V) *before* the step's forward. Copies are repeated, like the deltas, until a
plan that carried them has been recorded; repeating one is harmless.

**Verify rows** (speculative decoding, :mod:`pagedinfer.domain.speculative`): a chunk may run
past its sequence's last token into its drafts (``Sequence.spec_token_ids``). It is then
sampled at every query token from the sequence's last token on: ``verify_rows`` lists
``(row, first sample index, number of drafts m)``, the row's last ``m + 1`` query tokens are
sampled (samples ``first .. first + m``, in order, all under the row's slot) and its last
``m`` input ids are the drafts. Sample ``i`` is the token after draft ``i - 1``: penalties
count drafts ``0..i-1`` as generated before it, and the executor records (in the penalties'
history) only the samples up to the first that differs from its draft
(:func:`~pagedinfer.domain.speculative.accepted_length`), as the scheduler does.

**KV groups** (hybrid attention, :mod:`pagedinfer.domain.kv_groups`): ``block_tables`` and
``slot_mapping`` are group 0's; ``group_block_tables[g - 1]`` (``[B, W]``, the same width) and
``group_slot_mappings[g - 1]`` (``T``) are group ``g``'s, for the layers of that group. Both
are empty with one group. A sliding group's entries for blocks out of its window are the
null block (:attr:`~pagedinfer.domain.scheduler.group_allocator.GroupedBlockAllocator.null_block`,
a block no step writes): kernels must skip, or mask by position, the keys before
``p - window + 1``, as they do anyway.

**Prompt logprobs** (``SamplingParams.prompt_logprobs``): ``prompt_logprob_rows`` lists, per
prefill chunk of a request that asked, ``(sequence id, first query-token index, count)``: the
logits of those query tokens give the log-probability of the prompt token after each, whose
ids are in ``prompt_logprob_targets`` (in the same order). Every rank computes those logits
(the LM head may be split across ranks); only the sampling rank reads the targets.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from pagedinfer.domain.group_plan import chunk_group_tables
from pagedinfer.domain.lora import LoRARequest
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.sequence import Sequence

__all__ = [
    "BLOCK_TABLE_FILLER",
    "PADDING_SLOT",
    "PENDING_TOKEN",
    "BatchPlan",
    "NewRequest",
    "ScheduledChunk",
    "build_batch_plan",
    "mixed_batch_plan",
    "needs_prompt_tokens",
]

# Block-table entries past a sequence's last block. 0 keeps every gather in bounds; kernels
# never read those entries because they stop at the context length.
BLOCK_TABLE_FILLER = 0
# Slot of a token whose K/V must not be stored (CUDA-graph padding rows).
PADDING_SLOT = -1
# A token not known yet: the sample of the plan in flight, in a plan made ahead of it
# (``carried_rows``) and, until that plan is recorded, at the end of its sequence's tokens.
PENDING_TOKEN = -1


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at ``seq.num_computed_tokens``.

    ``forks`` are other completions of ``seq``'s request that sample from the same last row
    (the chunk must reach the end of ``seq``).
    """

    seq: Sequence
    num_tokens: int
    forks: tuple[Sequence, ...] = ()


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request the sampling executor has not seen: install ``params`` (and ``lora``) at
    ``slot``.

    ``prompt_token_ids`` is the prompt when the executor needs it (repetition penalty, prompt
    logprobs: :func:`needs_prompt_tokens`), else empty, so plans stay small.
    """

    seq_id: int
    slot: int
    params: SamplingParams
    num_prompt_tokens: int
    prompt_token_ids: tuple[int, ...] = ()
    # The LoRA adapter its rows run with (None: the base model): the executor maps the
    # request's rows to the adapter's device slot until the request's slot is released.
    lora: LoRARequest | None = None


def needs_prompt_tokens(params: SamplingParams) -> bool:
    """Whether the sampling executor needs a request's prompt tokens."""
    return params.repetition_penalty != 1.0 or params.prompt_logprobs is not None


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """One step, as flat arrays (see the module docstring for the full contract)."""

    is_prefill: bool
    block_size: int
    seq_ids: array[int]
    query_lens: array[int]
    context_lens: array[int]
    cu_seqlens_q: array[int]
    cu_seqlens_k: array[int]
    max_seqlen_q: int
    max_seqlen_k: int
    block_tables: array[int]
    block_table_width: int
    input_ids: array[int]
    positions: array[int]
    slot_mapping: array[int]
    sample_indices: array[int]
    sample_slots: array[int]
    released_slots: tuple[int, ...] = ()
    new_requests: tuple[NewRequest, ...] = ()
    # (sample index j, sequence id) of the samples that belong to another completion of the
    # row's request (n > 1), and the KV blocks to copy (source, destination) before the step.
    forks: tuple[tuple[int, int], ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()
    num_decode_rows: int = 0  # leading rows that are decode rows; see the module docstring
    prompt_logprob_rows: tuple[tuple[int, int, int], ...] = ()
    prompt_logprob_targets: array[int] = field(default_factory=lambda: array("q"))
    # Given by Scheduler.schedule(): this plan's number (1, 2, ...) and that of the latest plan
    # recorded before it was made (0: none); see pagedinfer.domain.executor.
    step_id: int = 0
    recorded_step_id: int = 0
    # Given by Scheduler.schedule_ahead(): decode rows whose input token is the previous plan's
    # sample carried_samples[i] (PENDING_TOKEN in input_ids); empty otherwise.
    carried_rows: array[int] = field(default_factory=lambda: array("q"))
    carried_samples: array[int] = field(default_factory=lambda: array("q"))
    # Given by Scheduler.schedule_ahead(): made while plan step_id - 1 runs, which is then
    # recorded after this plan was made (its step is not lost, though recorded_step_id is
    # older). False: every plan after recorded_step_id was dropped (pagedinfer.domain.executor).
    made_ahead: bool = False
    # Speculative decoding: (row, first sample index, number of drafts) of each verify row,
    # and (plans from build_batch_plan) each row's block count before the filler: a draft
    # model writes its next drafts' K/V into the blocks past the context.
    verify_rows: tuple[tuple[int, int, int], ...] = ()
    block_table_lens: array[int] = field(default_factory=lambda: array("i"))
    # Query tokens of chunks that are a sequence's last generated token (and its drafts):
    # decoding work outside decode rows (speculative decoding), for the engine's counters.
    num_generation_tokens: int = 0
    # KV groups 1, 2, ... (hybrid attention; group 0's are block_tables and slot_mapping).
    group_block_tables: tuple[array[int], ...] = ()
    group_slot_mappings: tuple[array[int], ...] = ()
    # Host KV tier (pagedinfer.domain.scheduler.tier): (device block, host slot) pairs to copy
    # out and (host slot, device block) pairs to copy in, every layer, K and V, before the
    # step's forward, copies out first. A plan with no rows may carry only these.
    kv_copies_out: tuple[tuple[int, int], ...] = ()
    kv_copies_in: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.is_prefill:  # a decode step: every row is a decode row
            object.__setattr__(self, "num_decode_rows", len(self.seq_ids))
        assert 0 <= self.num_decode_rows <= len(self.seq_ids), self.num_decode_rows

    @property
    def is_mixed(self) -> bool:
        """True for a step with decode rows and prefill chunks."""
        return self.is_prefill and self.num_decode_rows > 0

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

    @property
    def sampled_seq_ids(self) -> list[int]:
        """The sequence id of each sample, forks included: ``sampled_token_ids[j]`` of the
        step's output belongs to sequence ``sampled_seq_ids[j]``. Derived on each call (a
        binary search per prefill sample), so call it once per step."""
        num_decode = self.num_decode_rows  # decode rows are sampled in row order
        rows = [
            bisect_right(self.cu_seqlens_q, index) - 1 for index in self.sample_indices[num_decode:]
        ]
        seq_ids = self.seq_ids[:num_decode].tolist() + [self.seq_ids[row] for row in rows]
        for j, seq_id in self.forks:
            seq_ids[j] = seq_id
        return seq_ids

    def verify_drafts(self) -> list[tuple[int, int, list[int]]]:
        """``(row, first sample index, drafts)`` of each verify row: its drafts are its last
        ``count`` input ids (see the module docstring)."""
        ends = self.cu_seqlens_q
        return [
            (row, first, self.input_ids[ends[row + 1] - count : ends[row + 1]].tolist())
            for row, first, count in self.verify_rows
        ]

    def block_table(self, row: int) -> list[int]:
        """Row ``row`` of ``block_tables``, filler entries included."""
        width = self.block_table_width
        return self.block_tables[row * width : (row + 1) * width].tolist()


def build_batch_plan(
    chunks: SequenceABC[ScheduledChunk],
    *,
    is_prefill: bool,
    block_size: int,
    released_slots: tuple[int, ...] = (),
    new_requests: tuple[NewRequest, ...] = (),
    block_copies: tuple[tuple[int, int], ...] = (),
    step_id: int = 0,
    recorded_step_id: int = 0,
    made_ahead: bool = False,
    carried_rows: array[int] | None = None,
    carried_samples: array[int] | None = None,
    num_groups: int = 1,
) -> BatchPlan:
    """Lay out the scheduled chunks. Blocks for every slot must already be in the tables.

    A chunk that reaches its sequence's last token is sampled, under ``seq.slot``, and once
    more for each of its ``forks``, under theirs. The scheduler builds decode steps from its
    persistent rows instead (``DecodeBatch``); this builds prefill steps, and any plan a test
    wants. ``step_id`` ... ``carried_samples``: the plan's header (the scheduler numbers its
    plans and names the carried rows of a plan made ahead, see :class:`BatchPlan`).
    ``num_groups`` KV groups (hybrid attention): the plan carries groups ``1 ..
    num_groups - 1``'s tables and slots too, from each ``seq.group_block_tables``.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_q = [0]
    cu_k = [0]
    query_lens: list[int] = []
    context_lens: list[int] = []
    tables: list[list[int]] = []
    sample_indices: list[int] = []
    sample_slots: list[int] = []
    forks: list[tuple[int, int]] = []
    logprob_rows: list[tuple[int, int, int]] = []
    logprob_targets: list[int] = []
    verify_rows: list[tuple[int, int, int]] = []
    generation_tokens = 0
    for chunk in chunks:
        seq = chunk.seq
        start = seq.num_computed_tokens
        end = start + chunk.num_tokens
        table = seq.block_table
        num_drafts = end - seq.num_tokens  # > 0: the chunk runs into its drafts
        if seq.num_completion_tokens and end >= seq.num_tokens:  # from the last token on
            generation_tokens += end - max(start, seq.num_tokens - 1)
        if num_drafts > 0:
            input_ids.extend(seq.token_ids[start:])
            input_ids.extend(seq.spec_token_ids[:num_drafts])
        else:
            input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        _append_slots(slot_mapping, table, start, end, block_size)
        query_lens.append(chunk.num_tokens)
        context_lens.append(end)
        cu_q.append(cu_q[-1] + chunk.num_tokens)
        cu_k.append(cu_k[-1] + end)
        tables.append(table)
        if num_drafts > 0:  # a verify row: sampled from the last token on
            assert not chunk.forks, "forks sample from the prompt's last row"
            verify_rows.append((len(query_lens) - 1, len(sample_indices), num_drafts))
            sample_indices.extend(range(cu_q[-1] - 1 - num_drafts, cu_q[-1]))
            sample_slots.extend([seq.slot] * (num_drafts + 1))
        elif end == seq.num_tokens:  # the chunk reaches the last token: its logits are sampled
            sample_indices.append(cu_q[-1] - 1)
            sample_slots.append(seq.slot)
            for fork in chunk.forks:
                forks.append((len(sample_indices), fork.seq_id))
                sample_indices.append(cu_q[-1] - 1)
                sample_slots.append(fork.slot)
        else:
            assert not chunk.forks, "forks sample from the prompt's last row"
        if seq.params.prompt_logprobs is not None:
            # Positions start .. before the last prompt token: each predicts the next one.
            last = min(end, seq.num_prompt_tokens - 1)
            if last > start:
                first_row = cu_q[-2]
                logprob_rows.append((seq.seq_id, first_row, last - start))
                logprob_targets.extend(seq.token_ids[start + 1 : last + 1])
    width = max((len(table) for table in tables), default=0)
    flat: list[int] = []
    for table in tables:
        flat.extend(table)
        flat.extend([BLOCK_TABLE_FILLER] * (width - len(table)))
    group_tables, group_slot_mappings = (
        chunk_group_tables(
            [chunk.seq.group_block_tables for chunk in chunks],
            [
                (chunk.seq.num_computed_tokens, end)
                for chunk, end in zip(chunks, context_lens, strict=True)
            ],
            num_groups,
            width,
            block_size,
            BLOCK_TABLE_FILLER,
        )
        if num_groups > 1
        else ((), ())
    )
    return BatchPlan(
        is_prefill=is_prefill,
        block_size=block_size,
        seq_ids=array("q", [chunk.seq.seq_id for chunk in chunks]),
        query_lens=array("i", query_lens),
        context_lens=array("i", context_lens),
        cu_seqlens_q=array("i", cu_q),
        cu_seqlens_k=array("i", cu_k),
        max_seqlen_q=max(query_lens, default=0),
        max_seqlen_k=max(context_lens, default=0),
        block_tables=array("i", flat),
        block_table_width=width,
        input_ids=array("q", input_ids),
        positions=array("q", positions),
        slot_mapping=array("q", slot_mapping),
        sample_indices=array("q", sample_indices),
        sample_slots=array("i", sample_slots),
        released_slots=released_slots,
        new_requests=new_requests,
        forks=tuple(forks),
        block_copies=block_copies,
        step_id=step_id,
        recorded_step_id=recorded_step_id,
        made_ahead=made_ahead,
        carried_rows=array("q") if carried_rows is None else carried_rows,
        carried_samples=array("q") if carried_samples is None else carried_samples,
        prompt_logprob_rows=tuple(logprob_rows),
        prompt_logprob_targets=array("q", logprob_targets),
        verify_rows=tuple(verify_rows),
        # Decode plans (every row a decode row) carry neither, as DecodeBatch's do not.
        block_table_lens=array("i", [len(table) for table in tables] if is_prefill else []),
        num_generation_tokens=generation_tokens if is_prefill else 0,
        group_block_tables=group_tables,
        group_slot_mappings=group_slot_mappings,
    )


def mixed_batch_plan(
    decode: BatchPlan,
    prefill: BatchPlan,
    *,
    released_slots: tuple[int, ...] = (),
    new_requests: tuple[NewRequest, ...] = (),
    block_copies: tuple[tuple[int, int], ...] = (),
    step_id: int = 0,
    recorded_step_id: int = 0,
    made_ahead: bool = False,
    carried_rows: array[int] | None = None,
    carried_samples: array[int] | None = None,
) -> BatchPlan:
    """A mixed step: the rows of the decode step ``decode``, then the chunks of ``prefill``.

    Array fields are concatenated (row and sample offsets of the prefill part shifted: its
    ``forks`` and prompt-logprob rows too); the block tables are laid out at the wider of the
    two parts' widths. The parts' own deltas and copies are ignored: the step carries
    ``released_slots``, ``new_requests`` and ``block_copies``, and the header given
    (``step_id`` ... ``carried_samples``, as :func:`build_batch_plan`'s). KV groups: both
    parts carry every group's tables and slots, concatenated alike.
    """
    assert not decode.is_prefill and not decode.forks and prefill.num_decode_rows == 0
    assert decode.block_size == prefill.block_size
    num_rows = decode.num_seqs
    num_tokens = decode.num_tokens  # one per decode row
    num_keys = decode.cu_seqlens_k[-1]
    width = max(decode.block_table_width, prefill.block_table_width)
    assert len(decode.group_block_tables) == len(prefill.group_block_tables)
    return BatchPlan(
        is_prefill=True,
        block_size=decode.block_size,
        seq_ids=decode.seq_ids + prefill.seq_ids,
        query_lens=decode.query_lens + prefill.query_lens,
        context_lens=decode.context_lens + prefill.context_lens,
        cu_seqlens_q=decode.cu_seqlens_q + _shifted(prefill.cu_seqlens_q[1:], num_tokens),
        cu_seqlens_k=decode.cu_seqlens_k + _shifted(prefill.cu_seqlens_k[1:], num_keys),
        max_seqlen_q=max(decode.max_seqlen_q, prefill.max_seqlen_q),
        max_seqlen_k=max(decode.max_seqlen_k, prefill.max_seqlen_k),
        block_tables=_widened(decode.block_tables, num_rows, decode.block_table_width, width)
        + _widened(prefill.block_tables, prefill.num_seqs, prefill.block_table_width, width),
        block_table_width=width,
        input_ids=decode.input_ids + prefill.input_ids,
        positions=decode.positions + prefill.positions,
        slot_mapping=decode.slot_mapping + prefill.slot_mapping,
        sample_indices=decode.sample_indices + _shifted(prefill.sample_indices, num_tokens),
        sample_slots=decode.sample_slots + prefill.sample_slots,
        released_slots=released_slots,
        new_requests=new_requests,
        forks=tuple((j + decode.num_samples, seq_id) for j, seq_id in prefill.forks),
        block_copies=block_copies,
        step_id=step_id,
        recorded_step_id=recorded_step_id,
        made_ahead=made_ahead,
        carried_rows=array("q") if carried_rows is None else carried_rows,
        carried_samples=array("q") if carried_samples is None else carried_samples,
        num_decode_rows=num_rows,
        prompt_logprob_rows=tuple(
            (seq_id, first + num_tokens, count)
            for seq_id, first, count in prefill.prompt_logprob_rows
        ),
        prompt_logprob_targets=prefill.prompt_logprob_targets,
        verify_rows=tuple(
            (row + num_rows, first + decode.num_samples, count)
            for row, first, count in prefill.verify_rows
        ),
        block_table_lens=(
            decode.block_table_lens + prefill.block_table_lens
            if decode.block_table_lens and prefill.block_table_lens
            else array("i")
        ),
        num_generation_tokens=prefill.num_generation_tokens,
        group_block_tables=tuple(
            _widened(ours, num_rows, decode.block_table_width, width)
            + _widened(theirs, prefill.num_seqs, prefill.block_table_width, width)
            for ours, theirs in zip(
                decode.group_block_tables, prefill.group_block_tables, strict=True
            )
        ),
        group_slot_mappings=tuple(
            ours + theirs
            for ours, theirs in zip(
                decode.group_slot_mappings, prefill.group_slot_mappings, strict=True
            )
        ),
    )


def _shifted(values: array[int], offset: int) -> array[int]:
    return array(values.typecode, [value + offset for value in values])


def _widened(tables: array[int], num_rows: int, width: int, new_width: int) -> array[int]:
    """``[num_rows, width]`` row-major tables as ``[num_rows, new_width]``, filler-padded.

    One strided copy per column (a few per step), not one per row: decode steps may hold
    hundreds of rows, and tables only a few blocks wide.
    """
    if new_width == width:
        return tables
    wide = array(tables.typecode, [BLOCK_TABLE_FILLER]) * (num_rows * new_width)
    for column in range(width):
        wide[column::new_width] = tables[column::width]
    return wide


def _append_slots(out: list[int], table: list[int], start: int, end: int, block_size: int) -> None:
    position = start
    while position < end:
        index, offset = divmod(position, block_size)
        run = min(block_size - offset, end - position)
        base = table[index] * block_size + offset
        out.extend(range(base, base + run))
        position += run
