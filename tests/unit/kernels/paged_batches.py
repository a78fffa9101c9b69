"""Paged attention batches for kernel tests, built through the domain layer, and a dense oracle.

:func:`make_batch` lays out sequences the way the engine does: :class:`Sequence` objects with
block tables from a shuffled pool, :func:`build_batch_plan`, then the runner's packer
(:func:`~pagedinfer.adapters.step_inputs.plan_metadata`). The prefix of every context (the
tokens "computed in earlier steps") is written into the caches directly; this step's K/V are
returned for the backend to store. Cache slots nobody owns hold NaN, so a kernel that reads
outside a sequence's context, or a page it does not own, poisons its output.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from pagedinfer.adapters.attention.base import AttentionMetadata
from pagedinfer.adapters.step_inputs import plan_metadata
from pagedinfer.domain import ScheduledChunk, Sequence, build_batch_plan


@dataclass
class PagedBatch:
    meta: AttentionMetadata
    query: torch.Tensor  # [T, num_heads, head_dim]
    key: torch.Tensor  # [T, num_kv_heads, head_dim]: this step's K/V, not yet stored
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    keys: list[torch.Tensor]  # per sequence: K of all context positions, [ctx, kv_heads, dim]
    values: list[torch.Tensor]
    query_lens: list[int]
    context_lens: list[int]

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.query.shape[-1])

    def clean_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies with the poison replaced by zeros, for the torch oracle: it gathers whole
        pages and masks afterwards, and ``0 * NaN`` would poison it too."""
        return self.k_cache.nan_to_num(0.0), self.v_cache.nan_to_num(0.0)

    def torch_backend_output(self) -> torch.Tensor:
        """The torch backend's attention for this step, on clean copies of the caches."""
        from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend

        k_clean, v_clean = self.clean_caches()
        return TorchAttentionBackend(self.meta.block_size).forward(
            self.query, self.key, self.value, k_clean, v_clean, self.meta, self.scale
        )


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    is_prefill: bool = True,
    pending_tokens: int = 0,
    table_width: int | None = None,
    num_decode_rows: int = 0,
    seed: int = 0,
) -> PagedBatch:
    """A step in which sequence ``i`` computes its last ``query_lens[i]`` of
    ``context_lens[i]`` tokens. ``pending_tokens`` more prompt tokens follow each context
    (a chunk in the middle of a prompt); ``table_width`` pads the block tables (the
    fixed width of a captured CUDA graph); ``num_decode_rows`` marks the first rows (query
    length 1) as decode rows of a mixed step."""
    assert len(query_lens) == len(context_lens)
    assert all(0 < q <= c for q, c in zip(query_lens, context_lens, strict=True))
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks, generator=generator).tolist()  # shuffled page ids

    chunks = []
    for index, (q_len, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        seq = Sequence(index, list(range(ctx + pending_tokens)))
        seq.block_table = [pool.pop() for _ in range(blocks_per_seq[index])]
        seq.num_computed_tokens = ctx - q_len
        chunks.append(ScheduledChunk(seq, q_len))
    plan = build_batch_plan(chunks, is_prefill=is_prefill, block_size=block_size)
    if num_decode_rows:
        assert is_prefill and query_lens[:num_decode_rows] == [1] * num_decode_rows
        plan = dataclasses.replace(plan, num_decode_rows=num_decode_rows)
    meta = plan_metadata(plan, device)
    if table_width is not None:
        tables = meta.block_tables
        padded = torch.zeros(tables.shape[0], table_width, dtype=tables.dtype, device=device)
        padded[:, : tables.shape[1]] = tables
        meta = dataclasses.replace(meta, block_tables=padded)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    keys = [randn(ctx, num_kv_heads, head_dim) for ctx in context_lens]
    values = [randn(ctx, num_kv_heads, head_dim) for ctx in context_lens]
    step_keys, step_values = [], []
    for chunk, q_len, ctx, k, v in zip(chunks, query_lens, context_lens, keys, values, strict=True):
        for position in range(ctx - q_len):  # the cached prefix, stored by "earlier steps"
            page = chunk.seq.block_table[position // block_size]
            k_cache[page, position % block_size] = k[position]
            v_cache[page, position % block_size] = v[position]
        step_keys.append(k[ctx - q_len :])
        step_values.append(v[ctx - q_len :])
    num_tokens = sum(query_lens)
    return PagedBatch(
        meta=meta,
        query=randn(num_tokens, num_heads, head_dim),
        key=torch.cat(step_keys),
        value=torch.cat(step_values),
        k_cache=k_cache,
        v_cache=v_cache,
        keys=keys,
        values=values,
        query_lens=list(query_lens),
        context_lens=list(context_lens),
    )


def dense_reference(
    batch: PagedBatch,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention from the unpaged per-sequence K/V, in float64: ``[T, heads, dim]``.

    Query ``i`` of a sequence with ``q_len`` queries and ``ctx`` keys sits at position
    ``ctx - q_len + i`` (bottom-right aligned); with ``window`` it sees keys ``p - window <
    n <= p``; ``sinks`` (``[heads]``) add one logit per head to the softmax's denominator;
    ``softcap`` caps the scaled scores, ``softcap * tanh(scores / softcap)``, before the masks.
    """
    num_heads = batch.query.shape[1]
    outputs = []
    start = 0
    for q_len, ctx, k, v in zip(
        batch.query_lens, batch.context_lens, batch.keys, batch.values, strict=True
    ):
        group = num_heads // k.shape[1]
        q = batch.query[start : start + q_len].double().cpu()
        k = k.double().cpu().repeat_interleave(group, dim=1)
        v = v.double().cpu().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        rows = torch.arange(ctx - q_len, ctx)
        visible = torch.arange(ctx)[None, :] <= rows[:, None]
        if window is not None:
            visible &= torch.arange(ctx)[None, :] > rows[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.double().cpu()[:, None, None].expand(num_heads, q_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += q_len
    return torch.cat(outputs)


def drop_pages_left_of_window(batch: PagedBatch, window: int) -> None:
    """Point every block-table entry of a page wholly left of its sequence's first query's
    window at a page nobody owns (all NaN), as a KV manager that freed them may: a kernel
    that reads one poisons its output."""
    tables = batch.meta.block_tables
    owned = {int(page) for page in tables.flatten().tolist()}
    null_page = next(p for p in range(batch.k_cache.shape[0]) if p not in owned)
    block_size = batch.meta.block_size
    for row, (q_len, ctx) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
        first_key = max(0, ctx - q_len - window + 1)
        tables[row, : first_key // block_size] = null_page


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances against the float64 reference."""
    if dtype == torch.float32:
        return {"atol": 1e-4, "rtol": 1e-4}
    return {"atol": 5e-3, "rtol": 5e-3}
