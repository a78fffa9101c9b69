"""CUDA graphs for decode steps: capture once per batch-size bucket, replay every step.

A decode step launches a few hundred small kernels for a handful of tokens, so at small
batch sizes the CPU's launch overhead, not the GPU, sets the pace. Capturing the model's
forward pass in a CUDA graph turns those launches into one ``graph.replay()``.

A graph replays exactly the kernels, shapes and addresses it was captured with, so:

* **Buckets.** One graph per batch size in :func:`decode_graph_buckets` (1, 2, 4, 8, then
  multiples of 16, and always the largest, ``min(max_num_seqs, 512)``). A step of ``n``
  sequences replays the smallest bucket ``>= n``; the extra rows are padding.
* **Static inputs.** Every graph reads :class:`~pagedinfer.adapters.step_inputs.GraphInputs`,
  views of one device buffer allocated once for the largest bucket (bucket ``b`` reads their
  first ``b`` rows). The step packer writes a decode step straight into that buffer, in the
  step's one host-to-device copy (``adapters/step_inputs.py``); replay only replays. The block
  tables are ``cdiv(max_model_len, block_size)`` wide, so any sequence fits; a step's
  narrower table fills the left columns and the stale columns to its right are never read,
  because the kernels stop at the context length.
* **Padding rows** get slot ``-1`` (their K/V are not stored) and context length 0 (attention
  reads no page and returns zeros); their outputs are sliced away. Every layer treats rows
  independently, so padding never changes a real row.
* **KV groups** (hybrid attention, ``docs/kv-groups.md``): the static inputs hold a block
  table and a slot mapping per group, all as wide as the captured tables (a sliding group's
  table has the plan's width too: its entries out of the window are the null block, which the
  kernels skip by position). Each layer reads its group's views
  (``AttentionMetadata.for_group``); the packer writes every group's rows, and padding rows
  get slot ``-1`` in every group. The window and the sinks are arguments of the kernels, the
  same at every replay. A plan replays only with as many tables as were captured.
* **One memory pool.** All graphs share one pool, captured largest first: the smaller graphs'
  activations fit in memory the largest one already reserved.
* **No host values.** The attention metadata of a graph has no ``*_host`` lists, and the
  backend must declare ``supports_cuda_graphs``. Backends with device workspaces that grow
  on demand (the Triton split-KV partials) are asked to ``reserve`` the largest one before
  the first capture, so no graph keeps a private copy.

The sampler runs after replay, outside the graph (on rank 0 only): which sampling passes
run depends on each batch's parameters, which a graph cannot.

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
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.errors import ConfigurationError

if TYPE_CHECKING:
    from pagedinfer.adapters.models.base import CausalLM
    from pagedinfer.adapters.step_inputs import GraphInputs

__all__ = [
    "MAX_GRAPH_BATCH_SIZE",
    "CudaGraphDecodeRunner",
    "DecodeGraphLayout",
    "Replayable",
    "capture_decode_graphs",
    "decode_graph_buckets",
    "graph_metadata",
    "reads_device_values_on_host",
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
    """What was captured: the batch-size buckets, the block-table width of every graph and
    the number of KV groups (block tables per sequence; 1 without groups)."""

    buckets: tuple[int, ...]
    table_width: int
    block_size: int
    num_groups: int = 1

    @classmethod
    def for_limits(
        cls, *, max_num_seqs: int, max_model_len: int, block_size: int, num_groups: int = 1
    ) -> DecodeGraphLayout:
        """Buckets for ``max_num_seqs``; tables wide enough for a ``max_model_len`` sequence."""
        return cls(
            buckets=tuple(decode_graph_buckets(max_num_seqs)),
            table_width=-(-max_model_len // block_size),
            block_size=block_size,
            num_groups=num_groups,
        )

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` sequences; None above the largest."""
        index = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[index] if index < len(self.buckets) else None

    def covers(self, plan: BatchPlan) -> bool:
        """True for a decode step (one token per sequence) that some captured graph fits,
        with a block table per captured KV group."""
        return (
            not plan.is_prefill
            and plan.num_seqs > 0
            and plan.num_tokens == plan.num_seqs
            and plan.block_size == self.block_size
            and plan.block_table_width <= self.table_width
            and len(plan.group_block_tables) == self.num_groups - 1
            and self.bucket_for(plan.num_seqs) is not None
        )


def graph_metadata(static: GraphInputs, batch: int, block_size: int) -> AttentionMetadata:
    """Decode metadata over the first ``batch`` rows of the static inputs (views: what the
    packer writes later shows through), every KV group's tables and slots included. A graph
    captured over it reads no host values."""
    return AttentionMetadata(
        is_prefill=False,
        block_size=block_size,
        slot_mapping=static.slot_mapping[:batch],
        cu_seqlens_q=static.cu_seqlens_q[: batch + 1],
        cu_seqlens_k=static.cu_seqlens_k[: batch + 1],
        context_lens=static.context_lens[:batch],
        block_tables=static.block_tables[:batch],
        max_seqlen_q=1,
        max_seqlen_k=static.table_width * block_size,  # an upper bound
        has_cached_prefix=True,
        has_padding_slots=True,
        query_lens_host=None,  # replays must not depend on host values
        context_lens_host=None,
        group_block_tables=tuple(table[:batch] for table in static.group_block_tables),
        group_slot_mappings=tuple(slots[:batch] for slots in static.group_slot_mappings),
    )


def reads_device_values_on_host(model: torch.nn.Module) -> bool:
    """True when a module of ``model`` reads device values on the host in its forward pass
    (its class or instance sets ``reads_device_values_on_host = True``: GPT-OSS's experts on
    the torch path, which count each expert's tokens on the host). Such a forward cannot be
    captured: its decode steps run eagerly."""
    return any(getattr(module, "reads_device_values_on_host", False) for module in model.modules())


class Replayable(Protocol):
    """A captured graph (``torch.cuda.CUDAGraph``): re-runs its recorded work."""

    def replay(self) -> None: ...


class CudaGraphDecodeRunner:
    """Replays the captured decode graph of the smallest bucket that holds a step.

    Built by :func:`capture_decode_graphs`. ``graphs[b]`` recorded the model's forward pass
    over :func:`graph_metadata` of bucket ``b`` and left its hidden states in ``outputs[b]``
    (``[b, hidden]``). ``static`` are the inputs they read, which the step packer fills.
    """

    def __init__(
        self,
        layout: DecodeGraphLayout,
        static: GraphInputs,
        graphs: Mapping[int, Replayable],
        outputs: Mapping[int, torch.Tensor],
    ) -> None:
        assert set(graphs) == set(outputs) == set(layout.buckets), (graphs, layout)
        assert static.rows >= layout.largest and static.table_width == layout.table_width
        assert static.num_groups == layout.num_groups, (static.num_groups, layout.num_groups)
        self.layout = layout
        self.static = static
        self._graphs = dict(graphs)
        self._outputs = dict(outputs)
        self.num_replays = 0  # decode steps served by a graph (for stats and tests)

    def can_replay(self, plan: BatchPlan) -> bool:
        """True for a decode step a captured graph fits; False for prefill steps, batches
        larger than the largest bucket, and after :meth:`close`."""
        return bool(self._graphs) and self.layout.covers(plan)

    def bucket_for(self, plan: BatchPlan) -> int | None:
        """The bucket whose graph replays ``plan``, or None when it runs eagerly."""
        return self.layout.bucket_for(plan.num_seqs) if self.can_replay(plan) else None

    def replay(self, bucket: int, num_seqs: int) -> torch.Tensor:
        """Replay ``bucket``'s graph over the static inputs (already holding the step);
        return ``[num_seqs, hidden]``, a view of graph memory valid until the next replay."""
        assert self._graphs and 0 < num_seqs <= bucket, (bucket, num_seqs)
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
    layout: DecodeGraphLayout,
    static: GraphInputs,
    device: torch.device,
) -> CudaGraphDecodeRunner:
    """Capture one decode graph per bucket of ``layout`` over ``model``, its bound KV cache
    and the static inputs ``static`` (from :meth:`StepPacker.attach_graph_inputs`).

    Call after the KV cache is allocated and bound (the graphs record its addresses). Every
    capture runs with all rows as padding, so the cache is neither written nor read.
    """
    assert device.type == "cuda", device
    assert backend.supports_cuda_graphs, backend.name
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
            meta = graph_metadata(static, batch, layout.block_size)
            ids, positions = static.input_ids[:batch], static.positions[:batch]
            # Eager run first: compiles Triton kernels for this shape, creates cuBLAS handles
            # and workspaces, and runs the first collective, none of which may happen inside
            # a capture.
            model(ids, positions, meta)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[batch] = model(ids, positions, meta)
            graphs[batch] = graph
    torch.cuda.synchronize(device)
    return CudaGraphDecodeRunner(layout, static, graphs, outputs)
