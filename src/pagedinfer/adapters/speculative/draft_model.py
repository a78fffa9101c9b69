"""The draft-model proposer of speculative decoding: a smaller checkpoint guesses k tokens.

The draft model has its own KV cache with the target's block ids: block ``b`` of the draft
cache holds the draft's K/V of the same tokens as block ``b`` of the target's, so the
scheduler's block tables, prefix cache, preemption and block copies serve both, and a request's
draft K/V is freed with its blocks. To keep the two caches in step the draft runs every plan
the target runs (:meth:`DraftModelProposer.forward`, the same inputs, no logits). After the
step has sampled, :meth:`DraftModelProposer.propose` decodes greedily from each sampled
sequence's new last token, ``k`` forwards of one token per row, writing the draft's K/V at
the positions after it (the scheduler gives a verify row's blocks with ``k`` lookahead
positions, ``SchedulerConfig.num_lookahead_tokens``; a row whose blocks end sooner drafts
fewer tokens). Those positions are the next verify row's, whose forward writes them again.

Greedy drafts make the proposal a point mass, which is what the verification rule of
:mod:`pagedinfer.domain.speculative` assumes. A completion that forks (``n > 1``) in this
step gets no drafts yet: its copy of the prompt's last block is made before the next step.
"""

from __future__ import annotations

from array import array
from dataclasses import replace

import torch

from pagedinfer.adapters.attention import create_backend
from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS
from pagedinfer.adapters.host_transfers import HostUploads
from pagedinfer.adapters.kv_cache import allocate_kv_cache, kv_block_bytes
from pagedinfer.adapters.models.loader import load_weights
from pagedinfer.adapters.models.registry import build_model, read_model_config
from pagedinfer.adapters.step_inputs import StepInputs, StepPacker
from pagedinfer.domain.plan import BLOCK_TABLE_FILLER, PADDING_SLOT, BatchPlan
from pagedinfer.domain.speculative import accepted_length
from pagedinfer.errors import ConfigurationError

__all__ = ["DraftModelProposer"]


class DraftModelProposer:
    """A draft checkpoint, its KV cache (the target's block ids) and its greedy proposals."""

    def __init__(
        self,
        model_path: str,
        *,
        num_speculative_tokens: int,
        target_vocab_size: int,
        attention_backend: str,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.model_config = config = read_model_config(model_path)
        if config.vocab_size != target_vocab_size:
            raise ConfigurationError(
                f"the draft model {model_path} has a vocabulary of {config.vocab_size} tokens "
                f"and the target {target_vocab_size}: a draft must share the target's "
                "tokenizer. Choose a smaller checkpoint of the same family."
            )
        config.check_max_model_len(max_model_len)
        self.backend = create_backend(attention_backend, block_size)
        self.model = build_model(
            config, parallel=SINGLE_PROCESS, backend=self.backend, device=device, dtype=dtype
        )
        load_weights(self.model, model_path)
        self.block_bytes = kv_block_bytes(
            num_layers=config.num_hidden_layers,
            block_size=block_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=dtype,
        )
        self.packer = StepPacker(device, sampled=False, zero_copy=device.type == "cpu")
        self.uploads = HostUploads(device)  # the rows' first tokens, without a blocking copy
        self.kv_cache: torch.Tensor | None = None

    # --------------------------------------------------------------- KV cache
    def allocate(self, num_blocks: int) -> None:
        """The draft's cache, ``num_blocks`` blocks like the target's, bound to its layers."""
        config = self.model_config
        self.kv_cache = cache = allocate_kv_cache(
            num_layers=config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for index, layer in enumerate(self.model.attention_layers()):
            layer.bind_cache(cache[0, index], cache[1, index], None)

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """The target's block copies (``[n, 2]`` source, destination), in the draft cache."""
        cache = self.kv_cache
        if cache is not None:
            cache.index_copy_(2, pairs[:, 1], cache.index_select(2, pairs[:, 0]))

    def release_cache(self) -> None:
        """Drop the draft's cache (sleep mode; :meth:`allocate` makes a new one)."""
        if self.kv_cache is not None:
            for layer in self.model.attention_layers():
                layer.unbind_cache()
            self.kv_cache = None

    def close(self) -> None:
        self.release_cache()
        del self.model

    # ------------------------------------------------------------------ steps
    def forward(self, inputs: StepInputs) -> None:
        """Run the target's step (its inputs) through the draft: its K/V for those tokens."""
        if self.kv_cache is not None:  # (not while the target sizes its cache)
            self.model(inputs.input_ids, inputs.positions, inputs.meta)

    def propose(self, plan: BatchPlan, sampled: list[int]) -> dict[int, list[int]]:
        """Greedy drafts for each sequence that got tokens in ``plan`` (``sampled``: the
        step's samples, read on the host), by sequence id: from its new last token, at most
        ``k``. Called when the step's output is read (not in its launch); its one wait is
        the read of the drafts at the end."""
        if self.kv_cache is None:
            return {}
        rows = _sampled_rows(plan, sampled)
        size = self.block_size
        tables = [_block_table(plan, row, size) for row, _, _ in rows]
        # Each row drafts while its blocks hold the position its next input goes to.
        steps = [
            max(0, min(self.num_speculative_tokens, len(table) * size - position))
            for (_, _, position), table in zip(rows, tables, strict=True)
        ]
        tokens = self.uploads.upload([token for _, token, _ in rows], torch.int64)
        active = list(range(len(rows)))
        produced: list[tuple[list[int], torch.Tensor]] = []  # (rows, their drafts) per step
        with torch.inference_mode():
            for step in range(self.num_speculative_tokens):
                keep = [i for i in active if steps[i] > step]
                if not keep:
                    break
                if len(keep) < len(active):
                    index = self.uploads.upload([active.index(i) for i in keep], torch.int64)
                    tokens = tokens.index_select(0, index)
                    active = keep
                decode = _decode_plan(
                    plan,
                    [(rows[i][0], rows[i][2] + step) for i in active],
                    [tables[i] for i in active],
                    size,
                )
                inputs = replace(self.packer.pack(decode), input_ids=tokens)
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
                logits = self.model.compute_logits(hidden)
                assert logits is not None  # one rank: the whole vocabulary
                tokens = logits.argmax(dim=-1)
                produced.append((active, tokens))
        drafts: dict[int, list[int]] = {plan.seq_ids[row]: [] for row, _, _ in rows}
        if produced:  # one device-to-host copy for all steps
            values = torch.cat([step_tokens for _, step_tokens in produced]).tolist()
            offset = 0
            for step_rows, _ in produced:
                for i in step_rows:
                    drafts[plan.seq_ids[rows[i][0]]].append(values[offset])
                    offset += 1
        return drafts


def _sampled_rows(plan: BatchPlan, sampled: list[int]) -> list[tuple[int, int, int]]:
    """``(row, new last token, its position)`` of each row that sampled (not forks): a verify
    row's kept last sample, or a chunk's sample after its last token."""
    verify = {row: (first, drafts) for row, first, drafts in plan.verify_drafts()}
    fork_samples = {j for j, _ in plan.forks}
    result = []
    sample = 0
    for row in range(plan.num_seqs):
        end = plan.cu_seqlens_q[row + 1]
        if row in verify:
            first, drafts = verify[row]
            count = len(drafts)
            samples = sampled[first : first + count + 1]
            accepted = accepted_length(samples, drafts)
            position = plan.positions[end - count - 1] + accepted + 1
            result.append((row, samples[accepted], position))
            sample = first + count + 1
            continue
        if sample < plan.num_samples and plan.sample_indices[sample] == end - 1:
            result.append((row, sampled[sample], plan.positions[end - 1] + 1))
            sample += 1
            while sample in fork_samples:
                sample += 1
    return result


def _block_table(plan: BatchPlan, row: int, size: int) -> list[int]:
    """Row ``row``'s blocks without the filler (past its context: only where the plan says
    how many it holds, else none)."""
    table = plan.block_table(row)
    if plan.block_table_lens:
        return table[: plan.block_table_lens[row]]
    return table[: -(-plan.context_lens[row] // size)]


def _decode_plan(
    plan: BatchPlan, rows: list[tuple[int, int]], tables: list[list[int]], size: int
) -> BatchPlan:
    """One draft step: each ``(row, position)`` computes one token at ``position`` (input ids
    are filled in on the device), attending to everything before it in its row's blocks."""
    count = len(rows)
    positions = [position for _, position in rows]
    context = [position + 1 for position in positions]
    width = max(len(table) for table in tables)
    flat: list[int] = []
    slots: list[int] = []
    for (_, position), table in zip(rows, tables, strict=True):
        flat.extend(table)
        flat.extend([BLOCK_TABLE_FILLER] * (width - len(table)))
        block = table[position // size] if position // size < len(table) else None
        slots.append(PADDING_SLOT if block is None else block * size + position % size)
    cumulative = [0]
    for length in context:
        cumulative.append(cumulative[-1] + length)
    return BatchPlan(
        is_prefill=False,
        block_size=size,
        seq_ids=array("q", [plan.seq_ids[row] for row, _ in rows]),
        query_lens=array("i", [1] * count),
        context_lens=array("i", context),
        cu_seqlens_q=array("i", range(count + 1)),
        cu_seqlens_k=array("i", cumulative),
        max_seqlen_q=1,
        max_seqlen_k=max(context),
        block_tables=array("i", flat),
        block_table_width=width,
        input_ids=array("q", [0] * count),
        positions=array("q", positions),
        slot_mapping=array("q", slots),
        sample_indices=array("q", range(count)),
        sample_slots=array("i", [0] * count),
    )
