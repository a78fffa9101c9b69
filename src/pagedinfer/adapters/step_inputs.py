"""A step's device inputs: one host buffer, one host-to-device copy, views for every tensor.

``BatchPlan`` fields are flat ``array.array`` s of machine integers (``domain/plan.py``). The
:class:`StepPacker` turns a plan into the :class:`StepInputs` the model and the sampler read:

* **CUDA**: every field (and the sampling-table rows the plan installs) is ``memmove`` d into
  one pinned host buffer at 64-byte-aligned offsets, the buffer is copied to one device buffer
  with ``non_blocking=True``, and the step's tensors are views of that device buffer. One
  transfer per step, no host wait: the only device-to-host wait of a step is reading the
  sampled ids. Two pinned buffers alternate; before one is rewritten, the host waits for the
  copy that last read it (an event recorded after that copy, long finished in steady state:
  it orders the host after a copy that may still be queued behind a previous step).
* **Decode steps a CUDA graph replays** are packed in the graph's fixed layout (sized for the
  largest bucket, block tables ``cdiv(max_model_len, block_size)`` wide) and copied straight
  into the graph's static input buffer (:meth:`StepPacker.attach_graph_inputs`): no second
  copy on the device. Rows past the step's sequences up to the bucket are padding (slot -1 in
  every KV group, context length 0); the copy covers only the first ``bucket`` rows of the
  block tables. With KV groups (hybrid attention) row ``i`` of the static tables holds every
  group's table of sequence ``i`` side by side (each padded to 64 bytes, so every group's
  table starts aligned), and group ``g``'s table is a strided view (kernels take the row
  stride). A step's tables travel compact instead (``[groups, n, width]``: the step's own
  rows and columns, a ``memmove`` per group, in the same one copy) and one device copy puts
  them in place: the transfer does not grow with ``max_model_len`` times the groups.
* **CPU** (``zero_copy``): the tensors are views of the plan's own arrays
  (``torch.frombuffer``): nothing is copied at all.

This is the one place a plan becomes tensors: the attention metadata of a plan alone (kernel
tests, tools) comes from the same packer (:func:`plan_metadata`).

Aligned offsets matter beyond speed: Triton specializes kernels on pointer alignment, so a
field whose offset changed alignment from step to step would compile new variants mid-run.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedinfer.adapters.attention.base import AttentionMetadata
from pagedinfer.adapters.sampling.table import FLOAT_COLUMNS, INT_COLUMNS, TableDelta
from pagedinfer.domain.plan import PADDING_SLOT, BatchPlan

__all__ = ["GraphInputs", "StepInputs", "StepPacker", "pack_layout", "plan_metadata"]

ALIGNMENT = 64  # bytes; every field starts on a multiple
_INT64, _INT32, _FLOAT32 = torch.int64, torch.int32, torch.float32


@dataclass(frozen=True, slots=True)
class StepInputs:
    """A plan as device tensors: everything the model and the sampler read in one step.

    ``table_rows`` are the sampling-table rows this step installs (slots, floats, ints), on the
    device, for :meth:`~pagedinfer.adapters.sampling.table.SamplingTable.write_rows`.
    ``graph_batch`` is the bucket whose static inputs hold this step (a graph replays it).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor | None  # [S] int64; None when every row is sampled in order
    sample_slots: torch.Tensor  # [S] int32 (empty on ranks that do not sample)
    table_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    graph_batch: int | None = None

    def sample_positions(self) -> torch.Tensor:
        """The position of each sampled row's query token (for seeded sampling)."""
        if self.sample_indices is None:
            return self.positions
        return self.positions.index_select(0, self.sample_indices)


# -------------------------------------------------------------------------- layouts
@dataclass(frozen=True, slots=True)
class _Field:
    offset: int  # bytes from the buffer's start
    dtype: torch.dtype
    numel: int


def pack_layout(
    fields: Sequence[tuple[str, torch.dtype, int]],
) -> tuple[dict[str, _Field], int]:
    """Offsets of ``(name, dtype, numel)`` fields laid out in order, each aligned to
    :data:`ALIGNMENT` bytes; returns the fields and the total size in bytes."""
    layout: dict[str, _Field] = {}
    offset = 0
    for name, dtype, numel in fields:
        layout[name] = _Field(offset, dtype, numel)
        offset += -(-numel * dtype.itemsize // ALIGNMENT) * ALIGNMENT
    return layout, offset


def _plan_fields(
    plan: BatchPlan, delta: TableDelta | None, *, sampled: bool, every_row_sampled: bool
) -> list[tuple[str, torch.dtype, array[int] | array[float]]]:
    """The arrays one step moves to the device, in layout order (int64 first, then int32:
    the alignment holds either way)."""
    fields: list[tuple[str, torch.dtype, array[int] | array[float]]] = [
        ("input_ids", _INT64, plan.input_ids),
        ("positions", _INT64, plan.positions),
        ("slot_mapping", _INT64, plan.slot_mapping),
        ("context_lens", _INT32, plan.context_lens),
        ("cu_seqlens_q", _INT32, plan.cu_seqlens_q),
        ("cu_seqlens_k", _INT32, plan.cu_seqlens_k),
        ("block_tables", _INT32, plan.block_tables),
    ]
    if not every_row_sampled:
        fields.append(("sample_indices", _INT64, plan.sample_indices))
    if sampled:
        fields.append(("sample_slots", _INT32, plan.sample_slots))
    for group, (table, slots) in enumerate(
        zip(plan.group_block_tables, plan.group_slot_mappings, strict=True), start=1
    ):  # hybrid attention: KV groups 1, 2, ...
        fields += [(f"group_slots_{group}", _INT64, slots), (f"group_table_{group}", _INT32, table)]
    if delta is not None:
        fields += [
            ("delta_slots", _INT64, delta.slots),
            ("delta_floats", _FLOAT32, delta.floats),
            ("delta_ints", _INT64, delta.ints),
        ]
    return fields


def _view(buffer: torch.Tensor, field: _Field) -> torch.Tensor:
    end = field.offset + field.numel * field.dtype.itemsize
    return buffer[field.offset : end].view(field.dtype)


def _from_array(values: array[int] | array[float], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over the array's own memory (no copy)."""
    assert values.itemsize == dtype.itemsize, (values.typecode, dtype)
    if not values:  # frombuffer refuses empty buffers
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype)


def _memmove(destination: int, values: array[int] | array[float]) -> None:
    if values:
        address, length = values.buffer_info()
        ctypes.memmove(destination, address, length * values.itemsize)


# --------------------------------------------------------------------- host staging
class _HostStaging:
    """Alternating host buffers (pinned on CUDA) and the fence of the copy that last read each.

    The sliced views a copy reads and writes are kept by size (views cost microseconds each
    to make): graph steps repeat a few sizes, one per bucket.
    """

    _MAX_SLICES = 1024  # sizes of eager steps vary freely: forget them all past this many

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffers = [self._allocate(nbytes), self._allocate(nbytes)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._next = 0
        # (buffer index, nbytes) -> (the buffer's first nbytes, the target's), for one target
        self._slices: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._slices_target: torch.Tensor | None = None

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(max(nbytes, ALIGNMENT), dtype=torch.uint8, pin_memory=self._pinned)

    def acquire(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A host buffer of at least ``nbytes`` that no queued copy still reads."""
        index = self._next
        self._next ^= 1
        event = self._events[index]
        if event is not None:
            event.synchronize()  # in steady state long done; orders us after the copy
        if self._buffers[index].numel() < nbytes:
            self._buffers[index] = self._allocate(max(nbytes, 2 * self._buffers[index].numel()))
            self._slices.clear()
        return index, self._buffers[index]

    def copy(self, index: int, target: torch.Tensor, nbytes: int) -> None:
        """``target[:nbytes] <- host buffer index`` without blocking the host."""
        if nbytes == 0:
            return
        if target is not self._slices_target:  # a new target (the old one was outgrown)
            self._slices.clear()
            self._slices_target = target
        key = (index, nbytes)
        slices = self._slices.get(key)
        if slices is None:
            if len(self._slices) >= self._MAX_SLICES:
                self._slices.clear()
            slices = (self._buffers[index][:nbytes], target[:nbytes])
            self._slices[key] = slices
        slices[1].copy_(slices[0], non_blocking=True)
        if self._pinned:
            event = self._events[index] or torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            self._events[index] = event


# ---------------------------------------------------------------------- graph inputs
@dataclass(frozen=True, slots=True)
class GraphInputs:
    """The static tensors captured decode graphs read: views of one device buffer sized for
    ``rows`` sequences with ``table_width``-wide block tables. Bucket ``b`` reads rows ``:b``.

    KV groups 1, 2, ... (hybrid attention) have their own tables and slots (group 0's are
    ``block_tables`` and ``slot_mapping``); every group's table has the same width (a sliding
    group's entries out of its window are the null block, as in the plan)."""

    input_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    slot_mapping: torch.Tensor  # [rows] int64
    context_lens: torch.Tensor  # [rows] int32
    cu_seqlens_q: torch.Tensor  # [rows + 1] int32, always 0..rows (one query per sequence)
    cu_seqlens_k: torch.Tensor  # [rows + 1] int32
    block_tables: torch.Tensor  # [rows, table_width] int32
    group_block_tables: tuple[torch.Tensor, ...] = ()  # [rows, table_width] int32 each
    group_slot_mappings: tuple[torch.Tensor, ...] = ()  # [rows] int64 each

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def table_width(self) -> int:
        return int(self.block_tables.shape[1])

    @property
    def num_groups(self) -> int:
        """KV groups with a table here (1: no groups)."""
        return 1 + len(self.group_block_tables)


@dataclass(frozen=True, slots=True)
class _FirstRows:
    """The static inputs cut to a step's first ``n`` rows (what its tensors are)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    block_tables: torch.Tensor
    sample_slots: torch.Tensor
    group_block_tables: tuple[torch.Tensor, ...]
    group_slot_mappings: tuple[torch.Tensor, ...]


class _GraphRegion:
    """The graph's fixed layout: host mirrors and the device buffer the graphs read.

    Views are made once and kept: a step's tensors by its number of sequences, the host
    mirrors' block-table windows by shape (a view costs microseconds; a decode step would
    otherwise make a dozen).
    """

    def __init__(
        self, device: torch.device, rows: int, table_width: int, num_slots: int, num_groups: int
    ):
        self.rows, self.table_width, self.num_groups = rows, table_width, num_groups
        floats, ints = len(FLOAT_COLUMNS), len(INT_COLUMNS)
        # Where each group's slots go: group 0's are slot_mapping.
        self.slot_fields = ("slot_mapping", *(f"group_slots_{g}" for g in range(1, num_groups)))
        # KV groups: each group's table padded to 64 bytes in a row (Triton specializes on
        # pointer alignment: every group's table starts aligned, as the eager step's do).
        self.group_stride = table_width
        if num_groups > 1:
            self.group_stride = -(-table_width * 4 // ALIGNMENT) * ALIGNMENT // 4
        # Block tables after every per-row field: a step copies only its bucket's rows. KV
        # groups: the step's tables go through a compact staging field, and the static tables
        # (row i: every group's table of sequence i) come last, never copied from the host.
        table_field = ("block_tables", _INT32, rows * num_groups * self.group_stride)
        grouped = num_groups > 1
        staging_field = ("group_tables_staging", _INT32, rows * num_groups * table_width)
        self.layout, self.nbytes = pack_layout(
            [
                ("input_ids", _INT64, rows),
                ("positions", _INT64, rows),
                *((name, _INT64, rows) for name in self.slot_fields),
                ("context_lens", _INT32, rows),
                ("cu_seqlens_q", _INT32, rows + 1),
                ("cu_seqlens_k", _INT32, rows + 1),
                ("sample_slots", _INT32, rows),
                staging_field if grouped else table_field,
                ("delta_slots", _INT64, num_slots),
                ("delta_floats", _FLOAT32, num_slots * floats),
                ("delta_ints", _INT64, num_slots * ints),
                *((table_field,) if grouped else ()),
            ]
        )
        self.staging = _HostStaging(device, self.nbytes)
        self.device_buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        # Both host mirrors start as the device buffer will: all rows padding, fixed q offsets.
        host_buffers = self.staging._buffers
        for buffer in host_buffers:
            buffer.zero_()
            for name in self.slot_fields:
                _memmove(
                    buffer.data_ptr() + self.layout[name].offset, array("q", [PADDING_SLOT]) * rows
                )
            _view(buffer, self.layout["cu_seqlens_q"]).copy_(torch.arange(rows + 1))
        self.staging.copy(0, self.device_buffer, self.nbytes)
        self._tables = self.view("block_tables").view(rows, num_groups, self.group_stride)
        tables = self._tables[:, :, :table_width]
        self.tensors = GraphInputs(
            input_ids=self.view("input_ids"),
            positions=self.view("positions"),
            slot_mapping=self.view("slot_mapping"),
            context_lens=self.view("context_lens"),
            cu_seqlens_q=self.view("cu_seqlens_q"),
            cu_seqlens_k=self.view("cu_seqlens_k"),
            block_tables=tables[:, 0],
            group_block_tables=tuple(tables[:, g] for g in range(1, num_groups)),
            group_slot_mappings=tuple(self.view(name) for name in self.slot_fields[1:]),
        )
        self._sample_slots = self.view("sample_slots")
        self._host_tables = [  # no KV groups: a step's narrower tables are written here
            _view(buffer, self.layout["block_tables"]).view(rows, table_width)
            for buffer in (host_buffers if num_groups == 1 else [])
        ]
        self._first_rows: dict[int, _FirstRows] = {}
        self._table_windows: dict[tuple[int, int, int], torch.Tensor] = {}
        self._group_copies: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def view(self, name: str) -> torch.Tensor:
        return _view(self.device_buffer, self.layout[name])

    def first_rows(self, num_seqs: int) -> _FirstRows:
        """The static inputs' first ``num_seqs`` rows (``num_seqs + 1`` offsets)."""
        views = self._first_rows.get(num_seqs)
        if views is None:
            static = self.tensors
            views = _FirstRows(
                input_ids=static.input_ids[:num_seqs],
                positions=static.positions[:num_seqs],
                slot_mapping=static.slot_mapping[:num_seqs],
                context_lens=static.context_lens[:num_seqs],
                cu_seqlens_q=static.cu_seqlens_q[: num_seqs + 1],
                cu_seqlens_k=static.cu_seqlens_k[: num_seqs + 1],
                block_tables=static.block_tables[:num_seqs],
                sample_slots=self._sample_slots[:num_seqs],
                group_block_tables=tuple(t[:num_seqs] for t in static.group_block_tables),
                group_slot_mappings=tuple(s[:num_seqs] for s in static.group_slot_mappings),
            )
            self._first_rows[num_seqs] = views
        return views

    def host_table_window(self, index: int, num_seqs: int, width: int) -> torch.Tensor:
        """Host mirror ``index``'s block tables, first ``num_seqs`` rows and ``width`` columns."""
        key = (index, num_seqs, width)
        window = self._table_windows.get(key)
        if window is None:
            window = self._host_tables[index][:num_seqs, :width]
            self._table_windows[key] = window
        return window

    def group_table_copy(self, num_seqs: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV groups: the static tables' first ``num_seqs`` rows and ``width`` columns of every
        group, and the staged compact tables (``[groups, num_seqs, width]``) seen in that
        shape: the device copy that puts a step's tables in place."""
        key = (num_seqs, width)
        pair = self._group_copies.get(key)
        if pair is None:
            compact = self.view("group_tables_staging")[: self.num_groups * num_seqs * width]
            pair = (
                self._tables[:num_seqs, :, :width],
                compact.view(self.num_groups, num_seqs, width).transpose(0, 1),
            )
            self._group_copies[key] = pair
        return pair


# --------------------------------------------------------------------------- packer
class StepPacker:
    """Turns plans into :class:`StepInputs` on ``device`` (see the module docstring).

    ``sampled``: this rank samples (it needs the sample slots and the table rows).
    ``zero_copy``: the CPU path, tensors view the plan's arrays; otherwise every step is
    packed and copied (CUDA; also on the CPU in tests, where "device" memory is host memory).
    """

    def __init__(self, device: torch.device, *, sampled: bool, zero_copy: bool) -> None:
        assert not (zero_copy and device.type != "cpu"), "zero-copy views need CPU tensors"
        self.device = device
        self.sampled = sampled
        self.zero_copy = zero_copy
        self._staging = _HostStaging(device, 1 << 16)
        self._device_buffer = torch.empty(0, dtype=torch.uint8, device=device)
        self._graph: _GraphRegion | None = None
        self._no_slots = torch.empty(0, dtype=_INT32, device=device)  # ranks that do not sample

    # ------------------------------------------------------------------ eager steps
    def pack(self, plan: BatchPlan, delta: TableDelta | None = None) -> StepInputs:
        """The step's tensors, in a compact layout (or, zero-copy, the plan's own memory)."""
        # Decode: every row, in order (forks sample a row more than once, and skip others).
        every_row_sampled = plan.num_samples == plan.num_tokens and not plan.forks
        fields = _plan_fields(
            plan, delta, sampled=self.sampled, every_row_sampled=every_row_sampled
        )
        if self.zero_copy:
            tensors = {name: _from_array(values, dtype) for name, dtype, values in fields}
        else:
            layout, nbytes = pack_layout([(n, dtype, len(v)) for n, dtype, v in fields])
            index, host = self._staging.acquire(nbytes)
            base = host.data_ptr()
            for name, _, values in fields:
                _memmove(base + layout[name].offset, values)
            if self._device_buffer.numel() < nbytes:
                self._device_buffer = torch.empty(
                    max(nbytes, 2 * self._device_buffer.numel()),
                    dtype=torch.uint8,
                    device=self.device,
                )
            device_buffer = self._device_buffer
            self._staging.copy(index, device_buffer, nbytes)
            tensors = {name: _view(device_buffer, field) for name, field in layout.items()}
        width = plan.block_table_width
        if width:
            block_tables = tensors["block_tables"].view(-1, width)
        else:  # no sequence holds a block: one filler column keeps the shape valid
            block_tables = torch.zeros((plan.num_seqs, 1), dtype=_INT32, device=self.device)
        meta = AttentionMetadata(
            is_prefill=plan.is_prefill,
            block_size=plan.block_size,
            slot_mapping=tensors["slot_mapping"],
            cu_seqlens_q=tensors["cu_seqlens_q"],
            cu_seqlens_k=tensors["cu_seqlens_k"],
            context_lens=tensors["context_lens"],
            block_tables=block_tables,
            max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=plan.max_seqlen_k,
            has_cached_prefix=plan.has_cached_prefix,
            has_padding_slots=bool(plan.slot_mapping) and min(plan.slot_mapping) < 0,
            query_lens_host=plan.query_lens.tolist(),
            context_lens_host=plan.context_lens.tolist(),
            num_decode_rows=plan.num_decode_rows,
        )
        if plan.group_block_tables:
            groups = range(1, len(plan.group_block_tables) + 1)
            meta.group_slot_mappings = tuple(tensors[f"group_slots_{g}"] for g in groups)
            meta.group_block_tables = tuple(
                tensors[f"group_table_{g}"].view(-1, max(width, 1))
                if width
                else torch.zeros((plan.num_seqs, 1), dtype=_INT32, device=self.device)
                for g in groups
            )
        return StepInputs(
            input_ids=tensors["input_ids"],
            positions=tensors["positions"],
            meta=meta,
            sample_indices=tensors.get("sample_indices"),
            sample_slots=tensors.get("sample_slots", self._no_slots),
            table_rows=_table_rows(tensors),
        )

    # ------------------------------------------------------------------ graph steps
    def attach_graph_inputs(
        self, rows: int, table_width: int, num_slots: int, *, num_groups: int = 1
    ) -> GraphInputs:
        """Allocate the static inputs of captured decode graphs (once; they never move):
        ``num_groups`` block tables and slot mappings (KV groups; 1: the plan's own). Graphs
        captured again (sleep mode's wake-up) get the same inputs."""
        assert not self.zero_copy and num_groups >= 1
        if self._graph is not None:
            graph = self._graph
            assert (graph.rows, graph.table_width, graph.num_groups) == (
                rows,
                table_width,
                num_groups,
            ), "graph inputs are allocated once"
            return graph.tensors
        self._graph = _GraphRegion(self.device, rows, table_width, num_slots, num_groups)
        return self._graph.tensors

    def pack_graph_decode(
        self, plan: BatchPlan, bucket: int, delta: TableDelta | None = None
    ) -> StepInputs:
        """Write a decode step of ``n <= bucket`` sequences into the graph's static inputs:
        rows ``:n`` from the plan, rows ``n:bucket`` padding, rows past the bucket untouched
        (its graph does not read them). With KV groups, every group's table and slots."""
        graph = self._graph
        assert graph is not None, "attach_graph_inputs() first"
        num_seqs = plan.num_seqs
        width = plan.block_table_width
        assert 0 < num_seqs == plan.num_tokens <= bucket <= graph.rows, (num_seqs, bucket)
        assert 0 < width <= graph.table_width, (width, graph.table_width)
        assert len(plan.group_block_tables) == graph.num_groups - 1, "a table per KV group"
        layout = graph.layout
        index, host = graph.staging.acquire(graph.nbytes)
        base = host.data_ptr()
        _memmove(base + layout["input_ids"].offset, plan.input_ids)
        _memmove(base + layout["positions"].offset, plan.positions)
        group_slots = (plan.slot_mapping, *plan.group_slot_mappings)
        for name, slots in zip(graph.slot_fields, group_slots, strict=True):
            _memmove(base + layout[name].offset, slots)
        _memmove(base + layout["context_lens"].offset, plan.context_lens)
        _memmove(base + layout["cu_seqlens_k"].offset, plan.cu_seqlens_k)
        if self.sampled:
            _memmove(base + layout["sample_slots"].offset, plan.sample_slots)
        grouped = graph.num_groups > 1
        if grouped:  # every group's table, compact ([groups, n, width]): put in place below
            tables = layout["group_tables_staging"]
            step_bytes = num_seqs * width * 4
            for group, table in enumerate((plan.block_tables, *plan.group_block_tables)):
                _memmove(base + tables.offset + group * step_bytes, table)
        else:
            tables = layout["block_tables"]
            if width == graph.table_width:
                _memmove(base + tables.offset, plan.block_tables)
            else:  # narrower rows go into the left columns; stale columns are never read
                graph.host_table_window(index, num_seqs, width).copy_(
                    _from_array(plan.block_tables, _INT32).view(num_seqs, width)
                )
        if num_seqs < bucket:
            # Padding rows: no K/V store (in any group), no keys, an empty key range. Their
            # ids, positions and table rows are valid leftovers of earlier steps.
            padding = bucket - num_seqs
            for name in graph.slot_fields:
                _memmove(
                    base + layout[name].offset + num_seqs * 8, array("q", [PADDING_SLOT]) * padding
                )
            _memmove(base + layout["context_lens"].offset + num_seqs * 4, array("i", [0]) * padding)
            _memmove(
                base + layout["cu_seqlens_k"].offset + (num_seqs + 1) * 4,
                array("i", [plan.cu_seqlens_k[num_seqs]]) * padding,
            )
        nbytes = tables.offset + (
            graph.num_groups * num_seqs * width * 4 if grouped else bucket * graph.table_width * 4
        )
        table_rows = None
        if delta is not None:
            for name, values in (
                ("delta_slots", delta.slots),
                ("delta_floats", delta.floats),
                ("delta_ints", delta.ints),
            ):
                _memmove(base + layout[name].offset, values)
            field = layout["delta_ints"]
            nbytes = field.offset + len(delta.ints) * 8
            table_rows = (
                graph.view("delta_slots")[: len(delta)],
                graph.view("delta_floats")[: len(delta.floats)],
                graph.view("delta_ints")[: len(delta.ints)],
            )
        graph.staging.copy(index, graph.device_buffer, nbytes)
        if grouped:  # the step's tables, from the staging field into the static tables
            static_tables, staged = graph.group_table_copy(num_seqs, width)
            static_tables.copy_(staged)
        rows = graph.first_rows(num_seqs)
        meta = AttentionMetadata(
            is_prefill=False,
            block_size=plan.block_size,
            slot_mapping=rows.slot_mapping,
            cu_seqlens_q=rows.cu_seqlens_q,
            cu_seqlens_k=rows.cu_seqlens_k,
            context_lens=rows.context_lens,
            block_tables=rows.block_tables,
            max_seqlen_q=1,
            max_seqlen_k=plan.max_seqlen_k,
            has_cached_prefix=True,
            has_padding_slots=False,
            group_block_tables=rows.group_block_tables,
            group_slot_mappings=rows.group_slot_mappings,
        )
        return StepInputs(
            input_ids=rows.input_ids,
            positions=rows.positions,
            meta=meta,
            sample_indices=None,
            sample_slots=rows.sample_slots if self.sampled else self._no_slots,
            table_rows=table_rows,
            graph_batch=bucket,
        )


def _table_rows(
    tensors: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if "delta_slots" not in tensors:
        return None
    return tensors["delta_slots"], tensors["delta_floats"], tensors["delta_ints"]


def plan_metadata(plan: BatchPlan, device: torch.device) -> AttentionMetadata:
    """A plan's attention metadata on ``device``, through a packer of its own (views of the
    plan's arrays on the CPU, one copy elsewhere): for callers that run attention without a
    runner (kernel tests, benchmarks)."""
    packer = StepPacker(device, sampled=False, zero_copy=device.type == "cpu")
    return packer.pack(plan).meta
