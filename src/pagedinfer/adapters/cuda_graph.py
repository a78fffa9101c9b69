"""CUDA graphs for decode steps: capture once per batch-size bucket, replay every step.

A decode step launches a few hundred small kernels for a handful of tokens, so at small
batch sizes the CPU's launch overhead, not the GPU, sets the pace. Capturing the model's
forward pass in a CUDA graph turns those launches into one ``graph.replay()``.

A graph replays exactly the kernels, shapes and addresses it was captured with, so:

* **Buckets.** One graph per batch size in :func:`decode_graph_buckets` (1, 2, 4, 8, then
  multiples of 16, and always the largest, ``min(max_num_seqs, 512)``). A step of ``n``
  sequences replays the smallest bucket ``>= n``; the extra rows are padding.
* **Static inputs.** Every graph reads :class:`StaticDecodeInputs`, tensors allocated once
  for the largest bucket (bucket ``b`` reads their first ``b`` rows). Replay copies the step
  into them. The block tables are ``cdiv(max_model_len, block_size)`` wide, so any sequence
  fits; a step's narrower table is copied into the left columns and the stale columns to its
  right are never read, because the kernels stop at the context length.
* **Padding rows** get slot ``-1`` (their K/V are not stored) and context length 0 (attention
  reads no page and returns zeros); their outputs are sliced away. Every layer treats rows
  independently, so padding never changes a real row.
* **One memory pool.** All graphs share one pool, captured largest first: the smaller graphs'
  activations fit in memory the largest one already reserved.
* **No host values.** The attention metadata of a graph has no ``*_host`` lists, and the
  backend must declare ``supports_cuda_graphs``. Backends with device workspaces that grow
  on demand (the Triton split-KV partials) are asked to ``reserve`` the largest one before
  the first capture, so no graph keeps a private copy.

The sampler runs after replay, outside the graph (on rank 0 only): sampling draws from
per-request generators and varies with each batch's parameters, which a graph cannot.

Tensor parallelism: every rank captures the same buckets in the same order (they depend only
on the shared configuration), so the collectives recorded inside the graphs pair up across
ranks, and every rank replays the same bucket for the same plan.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from pagedinfer.adapters.attention.base import AttentionBackend, AttentionMetadata
from pagedinfer.domain.plan import PADDING_SLOT, BatchPlan
from pagedinfer.errors import ConfigurationError

if TYPE_CHECKING:
    from pagedinfer.adapters.model_runner import StepInputs
    from pagedinfer.adapters.models.base import CausalLM

__all__ = [
    "MAX_GRAPH_BATCH_SIZE",
    "CudaGraphDecodeRunner",
    "DecodeGraphLayout",
    "Replayable",
    "StaticDecodeInputs",
    "capture_decode_graphs",
    "decode_graph_buckets",
]

# Larger decode batches run eagerly: launch overhead is small next to their compute, and each
# captured bucket costs capture time and graph memory.
MAX_GRAPH_BATCH_SIZE = 512
_SMALL_BUCKETS = (1, 2, 4, 8)
_BUCKET_STEP = 16


def decode_graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, multiples of 16, and ``min(max_num_seqs, 512)``.

    The largest bucket is always included, so every batch up to it has a graph:
    ``decode_graph_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]``.
    """
    if max_num_seqs < 1:
        raise ConfigurationError(f"max_num_seqs={max_num_seqs} is invalid: expected >= 1.")
    largest = min(max_num_seqs, MAX_GRAPH_BATCH_SIZE)
    buckets = [size for size in _SMALL_BUCKETS if size <= largest]
    buckets.extend(range(_BUCKET_STEP, largest + 1, _BUCKET_STEP))
    if buckets[-1] != largest:
        buckets.append(largest)
    return buckets


@dataclass(frozen=True, slots=True)
class DecodeGraphLayout:
    """What was captured: the batch-size buckets and the block-table width of every graph."""

    buckets: tuple[int, ...]
    table_width: int
    block_size: int

    @classmethod
    def for_limits(
        cls, *, max_num_seqs: int, max_model_len: int, block_size: int
    ) -> DecodeGraphLayout:
        """Buckets for ``max_num_seqs``; tables wide enough for a ``max_model_len`` sequence."""
        return cls(
            buckets=tuple(decode_graph_buckets(max_num_seqs)),
            table_width=-(-max_model_len // block_size),
            block_size=block_size,
        )

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` sequences; None above the largest."""
        index = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[index] if index < len(self.buckets) else None

    def covers(self, plan: BatchPlan) -> bool:
        """True for a decode step (one token per sequence) that some captured graph fits."""
        return (
            not plan.is_prefill
            and plan.num_seqs > 0
            and plan.num_tokens == plan.num_seqs
            and plan.block_size == self.block_size
            and plan.block_table_width <= self.table_width
            and self.bucket_for(plan.num_seqs) is not None
        )


class StaticDecodeInputs:
    """The tensors captured graphs read, allocated once for the largest bucket.

    Graphs are captured over views of these tensors (:meth:`metadata`), so writing a step
    into them (:meth:`load`) is what feeds a replay. Device-agnostic: the same layout works
    on the CPU, which is how the padding rules are tested without a GPU.
    """

    def __init__(self, layout: DecodeGraphLayout, device: torch.device) -> None:
        rows = layout.largest
        self.layout = layout
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        # Until a step is loaded every row is padding: graphs are captured over these values,
        # so capture neither stores K/V nor reads a page.
        self.slot_mapping = torch.full((rows,), PADDING_SLOT, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            (rows, layout.table_width), dtype=torch.int32, device=device
        )
        # One query per sequence: the query offsets never change.
        self.cu_seqlens_q = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.cu_seqlens_k = torch.zeros(rows + 1, dtype=torch.int32, device=device)

    def metadata(self, batch: int) -> AttentionMetadata:
        """Decode metadata over the first ``batch`` rows (views: later loads show through)."""
        layout = self.layout
        return AttentionMetadata(
            is_prefill=False,
            block_size=layout.block_size,
            slot_mapping=self.slot_mapping[:batch],
            cu_seqlens_q=self.cu_seqlens_q[: batch + 1],
            cu_seqlens_k=self.cu_seqlens_k[: batch + 1],
            context_lens=self.context_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_seqlen_q=1,
            max_seqlen_k=layout.table_width * layout.block_size,  # an upper bound
            has_cached_prefix=True,
            has_padding_slots=True,
            query_lens_host=None,  # replays must not depend on host values
            context_lens_host=None,
        )

    def load(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, batch: int
    ) -> None:
        """Copy a decode step of ``n <= batch`` sequences in; rows ``n..batch`` become padding.

        Rows past ``batch`` are not touched: the graph of bucket ``batch`` does not read them.
        """
        num_seqs = int(input_ids.shape[0])
        assert 0 < num_seqs <= batch <= self.layout.largest, (num_seqs, batch)
        width = int(meta.block_tables.shape[1])
        assert width <= self.layout.table_width, (width, self.layout.table_width)
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self.context_lens[:num_seqs].copy_(meta.context_lens)
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        self.cu_seqlens_k[: num_seqs + 1].copy_(meta.cu_seqlens_k)
        if num_seqs < batch:
            # Padding rows: no K/V store, no keys; their stale ids, positions and table rows
            # are valid leftovers of earlier steps and only feed rows that are sliced away.
            self.slot_mapping[num_seqs:batch].fill_(PADDING_SLOT)
            self.context_lens[num_seqs:batch].zero_()
            self.cu_seqlens_k[num_seqs + 1 : batch + 1].copy_(
                meta.cu_seqlens_k[num_seqs:].expand(batch - num_seqs)
            )


class Replayable(Protocol):
    """A captured graph (``torch.cuda.CUDAGraph``): re-runs its recorded work."""

    def replay(self) -> None: ...


class CudaGraphDecodeRunner:
    """Replays the captured decode graph of the smallest bucket that holds a step.

    Built by :func:`capture_decode_graphs`. ``graphs[b]`` recorded the model's forward pass
    over ``inputs.metadata(b)`` and left its hidden states in ``outputs[b]`` (``[b, hidden]``).
    """

    def __init__(
        self,
        layout: DecodeGraphLayout,
        inputs: StaticDecodeInputs,
        graphs: Mapping[int, Replayable],
        outputs: Mapping[int, torch.Tensor],
    ) -> None:
        assert set(graphs) == set(outputs) == set(layout.buckets), (graphs, layout)
        self.layout = layout
        self.inputs = inputs
        self._graphs = dict(graphs)
        self._outputs = dict(outputs)
        self.num_replays = 0  # decode steps served by a graph (for stats and tests)

    def can_replay(self, plan: BatchPlan) -> bool:
        """True for a decode step a captured graph fits; False for prefill steps, batches
        larger than the largest bucket, and after :meth:`close`."""
        return bool(self._graphs) and self.layout.covers(plan)

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """Load the step, replay its bucket's graph, return ``[num_seqs, hidden]``.

        The result is a view of graph memory: it is valid until the next replay of any graph.
        """
        num_seqs = int(inputs.input_ids.shape[0])
        bucket = self.layout.bucket_for(num_seqs)
        assert bucket is not None and self._graphs, (num_seqs, self.layout.largest)
        self.inputs.load(inputs.input_ids, inputs.positions, inputs.meta, bucket)
        self._graphs[bucket].replay()
        self.num_replays += 1
        return self._outputs[bucket][:num_seqs]

    def close(self) -> None:
        """Release the graphs and their memory pool. Safe to call twice."""
        self._graphs.clear()
        self._outputs.clear()


@runtime_checkable
class _ReservesWorkspace(Protocol):
    """Backends whose decode workspace must be allocated before capture (Triton split-KV)."""

    def reserve(
        self,
        max_num_seqs: int,
        num_heads: int,
        head_dim: int,
        *,
        num_kv_heads: int = 1,
        device: torch.device | str = "cuda",
    ) -> None: ...


def capture_decode_graphs(
    model: CausalLM,
    backend: AttentionBackend,
    *,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    device: torch.device,
) -> CudaGraphDecodeRunner:
    """Capture one decode graph per bucket over ``model`` and its bound KV cache.

    Call after the KV cache is allocated and bound (the graphs record its addresses). Every
    capture runs with all rows as padding, so the cache is neither written nor read.
    """
    assert device.type == "cuda", device
    assert backend.supports_cuda_graphs, backend.name
    layout = DecodeGraphLayout.for_limits(
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size
    )
    inputs = StaticDecodeInputs(layout, device)
    if isinstance(backend, _ReservesWorkspace):
        attention = model.attention_layers()[0]  # per-rank head counts
        backend.reserve(
            layout.largest,
            attention.num_heads,
            attention.head_dim,
            num_kv_heads=attention.num_kv_heads,
            device=device,
        )
    graphs: dict[int, Replayable] = {}
    outputs: dict[int, torch.Tensor] = {}
    pool = torch.cuda.graph_pool_handle()
    with torch.inference_mode():
        for batch in reversed(layout.buckets):  # largest first: it sizes the shared pool
            meta = inputs.metadata(batch)
            ids, positions = inputs.input_ids[:batch], inputs.positions[:batch]
            # Eager run first: compiles Triton kernels for this shape, creates cuBLAS handles
            # and workspaces, and runs the first collective, none of which may happen inside
            # a capture.
            model(ids, positions, meta)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[batch] = model(ids, positions, meta)
            graphs[batch] = graph
    torch.cuda.synchronize(device)
    return CudaGraphDecodeRunner(layout, inputs, graphs, outputs)
