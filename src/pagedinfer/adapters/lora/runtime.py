"""``LoRARuntime``: many LoRA adapters over one model, mixed row by row in every step.

Each adapted projection (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` of every
decoder layer) gets a forward hook that adds ``B (A x)`` of each token's adapter to the base
output (:mod:`pagedinfer.adapters.lora.ops`); the packed projections hold one ``A``/``B`` pair
per packed module (q, k, v; gate, up), each adding into its share of the output. The weights
live in ``max_loras`` device slots of fixed shape (rank padded to ``max_lora_rank``), and each
step's token -> slot map is a fixed device buffer (``-1``: the base model): a CUDA graph
captured once replays any mix of adapters, and a step of base rows only skips the hooks when
it runs eagerly.

:meth:`LoRARuntime.begin` reads a plan: the adapters of new requests (``NewRequest.lora``,
kept by sequence id until the request's sampling slot is released), the adapter of each row,
slots for the step's adapters (:class:`~pagedinfer.adapters.lora.slots.SlotAssignment`; the
tensors of a newly placed adapter come from the host cache, or its files), then the token ->
slot buffer. With tensor parallelism each rank holds its shard of every adapter, split as
its base layer: ``B``'s rows for the column-parallel projections, ``A``'s columns for the
row-parallel ones (whose partial shrinks are summed over the ranks). Pipeline parallelism is
refused.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS, ParallelContext
from pagedinfer.adapters.lora.ops import lora_expand, lora_shrink, slot_mask
from pagedinfer.adapters.lora.peft import AdapterWeights, load_adapter, target_shapes
from pagedinfer.adapters.lora.slots import HostCache, SlotAssignment
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.domain.lora import LoRARequest
from pagedinfer.domain.plan import BatchPlan

__all__ = ["PACKED_TARGETS", "LoRALayer", "LoRARuntime"]

PACKED_TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
"""PEFT's target module -> (our projection in the layer, its part of the packed output)."""

_PARTS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
_ROW_PARALLEL = frozenset({"self_attn.o_proj", "mlp.down_proj"})
_MODULE = re.compile(
    r"^model\.layers\.(\d+)\.(self_attn\.(?:qkv|o)_proj|mlp\.(?:gate_up|down)_proj)$"
)


@dataclass(frozen=True, slots=True)
class _Part:
    target: str  # PEFT's module name
    start: int  # its columns in the projection's output
    size: int


class _TritonLoRA:
    """The Triton shrink/expand, imported only where they run (Triton is a CUDA extra)."""

    def __init__(self) -> None:
        from pagedinfer.adapters.kernels.lora import lora_expand_triton, lora_shrink_triton

        self.shrink = lora_shrink_triton
        self.expand = lora_expand_triton


class LoRALayer:
    """The slots of one projection: ``a`` ``[S, parts * r, in]`` (the parts' ``A`` stacked,
    one shrink for all) and one ``b`` ``[S, r, out_part]`` per part."""

    def __init__(
        self,
        runtime: LoRARuntime,
        parts: Sequence[_Part],
        in_features: int,
        *,
        num_slots: int,
        rank: int,
        device: torch.device,
        dtype: torch.dtype,
        row_parallel: bool = False,
    ) -> None:
        self.runtime = runtime
        self.parts = tuple(parts)
        self.rank = rank
        # Row-parallel (o_proj, down_proj) over ranks: each rank's A holds its slice of the
        # input features, so the shrink is a partial sum, summed over the ranks before the
        # expand (B whole); column-parallel projections hold their rows of B, A whole.
        self.reduce_shrink = row_parallel and runtime.parallel.world_size > 1
        self.a = torch.zeros(num_slots, len(parts) * rank, in_features, device=device, dtype=dtype)
        self.b = [
            torch.zeros(num_slots, rank, part.size, device=device, dtype=dtype) for part in parts
        ]

    def write_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter's ``(A [r', in], scaling * B^T [r', out])`` per target in ``slot``
        (zeros for the targets it does not adapt, and past its rank ``r'``)."""
        rank = self.rank
        self.a[slot].zero_()
        for index, part in enumerate(self.parts):
            b = self.b[index][slot]
            b.zero_()
            found = weights.get(part.target)
            if found is None:
                continue
            a_part, b_part = found
            own = a_part.shape[0]
            self.a[slot, index * rank : index * rank + own].copy_(a_part)
            b[:own].copy_(b_part)

    def __call__(
        self, module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> torch.Tensor:
        runtime = self.runtime
        if not runtime.active:
            return out
        x = inputs[0]
        rank = self.rank
        kernels = runtime.kernels
        if kernels is not None:  # Triton: each token reads its own adapter only
            slots = runtime.token_slots[: x.shape[0]]
            shrunk = kernels.shrink(x.contiguous(), self.a, slots)
            if self.reduce_shrink:
                shrunk = runtime.parallel.all_reduce(shrunk)
            for index, part in enumerate(self.parts):
                own = shrunk[:, index * rank : (index + 1) * rank]
                columns = out[:, part.start : part.start + part.size]
                kernels.expand(columns, own, self.b[index], slots)
            return out
        # The twins compute every slot up to the step's highest (slots fill from 0).
        used = runtime.slot_limit
        mask = runtime.mask(x.shape[0], x.dtype)
        shrunk = lora_shrink(x, self.a[:used], mask)
        if self.reduce_shrink:
            shrunk = runtime.parallel.all_reduce(shrunk)
        for index, part in enumerate(self.parts):
            own = shrunk[:, index * rank : (index + 1) * rank]
            columns = out[:, part.start : part.start + part.size]
            lora_expand(columns, own, self.b[index][:used], mask)
        return out


class LoRARuntime:
    """The adapters of one model: its hooked projections, slots, host cache and the step's
    token -> slot map (``max_tokens`` long: the most tokens a step or a graph holds)."""

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        max_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        use_kernels: bool = False,
        parallel: ParallelContext = SINGLE_PROCESS,
    ) -> None:
        self.config = config
        self.parallel = parallel
        # The Triton pair on CUDA (adapters/kernels/lora.py), else the torch twins.
        self.kernels = _TritonLoRA() if use_kernels else None
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.num_slots = max_loras
        self.slot_limit = max_loras  # this step's highest slot + 1 (the twins' work)
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        # Eager steps of base rows only skip the hooks; warm-up and capture run them.
        self.active = True
        self._slots = SlotAssignment(max_loras)
        self._host: HostCache[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = HostCache(
            max_cpu_loras
        )
        self._known: dict[int, LoRARequest] = {}  # adapter id -> the request that named it
        self._seq_adapter: dict[int, int] = {}  # sequence id -> adapter id
        self._slot_seq: dict[int, int] = {}  # sampling slot -> sequence id
        self._mask_cache: tuple[int, torch.dtype, torch.Tensor] | None = None
        self.layers: dict[tuple[int, str], LoRALayer] = {}
        self._handles: list[RemovableHandle] = []
        shapes = target_shapes(config)
        for name, module in model.named_modules():
            match = _MODULE.match(name)
            if match is None or any(target not in shapes for target in _PARTS[match[2]]):
                continue
            row_parallel = match[2] in _ROW_PARALLEL
            world = parallel.world_size
            parts: list[_Part] = []
            start = 0
            for target in _PARTS[match[2]]:
                size = shapes[target][1] // (1 if row_parallel else world)  # this rank's
                parts.append(_Part(target, start, size))
                start += size
            in_features = shapes[_PARTS[match[2]][0]][0] // (world if row_parallel else 1)
            layer = LoRALayer(
                self,
                parts,
                in_features,
                num_slots=max_loras,
                rank=max_lora_rank,
                device=device,
                dtype=dtype,
                row_parallel=row_parallel,
            )
            self.layers[int(match[1]), match[2]] = layer
            self._handles.append(module.register_forward_hook(layer))
        # The one-hot is made once per forward, inside it (so a captured graph remakes it).
        self._handles.append(model.register_forward_pre_hook(self._forget_mask))

    # ------------------------------------------------------------------ steps
    def _forget_mask(self, module: nn.Module, inputs: object) -> None:
        self._mask_cache = None

    def capture_all(self) -> None:
        """Before a warm-up or a graph capture: run the hooks (every token base)."""
        self.token_slots.fill_(-1)
        self.active = True
        self.slot_limit = self.num_slots

    def mask(self, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """``[num_tokens, S]``: the step's token -> slot one-hot, made once per forward."""
        cached = self._mask_cache
        if cached is not None and cached[0] == num_tokens and cached[1] == dtype:
            return cached[2]
        mask = slot_mask(self.token_slots[:num_tokens], self.slot_limit, dtype)
        self._mask_cache = (num_tokens, dtype, mask)
        return mask

    def begin(self, plan: BatchPlan, num_tokens: int) -> None:
        """Read ``plan``'s adapters into the slots and the token -> slot buffer, whose first
        ``num_tokens`` entries the forward reads (a graph's bucket: rows past the plan's are
        padding, base)."""
        for slot in plan.released_slots:
            seq_id = self._slot_seq.pop(slot, None)
            if seq_id is not None:
                self._seq_adapter.pop(seq_id, None)
        for request in plan.new_requests:
            old = self._slot_seq.get(request.slot)
            if old is not None and old != request.seq_id:
                self._seq_adapter.pop(old, None)
            self._slot_seq[request.slot] = request.seq_id
            if request.lora is None:
                self._seq_adapter.pop(request.seq_id, None)
                continue
            self._known[request.lora.lora_int_id] = request.lora
            self._seq_adapter[request.seq_id] = request.lora.lora_int_id
        adapters = self._seq_adapter
        row_adapters = [adapters.get(seq_id, 0) for seq_id in plan.seq_ids]
        needed = {adapter for adapter in row_adapters if adapter}
        self.active = bool(needed)
        if not needed:  # (a graph replays the hooks anyway: every token is base)
            self.token_slots[:num_tokens].fill_(-1)
            return
        slot_of, loads = self._slots.assign(needed)
        self.slot_limit = max(slot_of.values()) + 1
        for slot, adapter_id in loads:
            self._write_slot(slot, adapter_id)
        per_token: list[int] = []
        for adapter_id, length in zip(row_adapters, plan.query_lens, strict=True):
            per_token.extend([slot_of[adapter_id] if adapter_id else -1] * length)
        per_token.extend([-1] * (num_tokens - len(per_token)))
        host = torch.tensor(per_token, dtype=torch.int64)
        if self.token_slots.is_cuda:  # pinned: the copy queues behind the step in flight
            host = host.pin_memory()
        self.token_slots[:num_tokens].copy_(host, non_blocking=True)

    def _write_slot(self, slot: int, adapter_id: int) -> None:
        request = self._known[adapter_id]
        tensors = self._host.get(adapter_id, lambda: self._load(request))
        per_layer: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, target), pair in tensors.items():
            projection = PACKED_TARGETS[target][0]
            per_layer.setdefault((layer, projection), {})[target] = pair
        for key, lora_layer in self.layers.items():
            lora_layer.write_slot(slot, per_layer.get(key, {}))

    def _load(
        self, request: LoRARequest
    ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """An adapter's tensors as the slots take them: ``A``, and ``scaling * B^T``, in the
        model's dtype, on the host."""
        weights: AdapterWeights = load_adapter(request.lora_path, self.config, self.max_lora_rank)
        scaling = weights.header.scaling
        rank, world = self.parallel.rank, self.parallel.world_size
        tensors = {}
        for key, (a, b) in weights.tensors.items():
            b_t = b.t() * scaling  # [r, out]
            if world > 1:  # this rank's shard, as its base layer's
                if PACKED_TARGETS[key[1]][0] in _ROW_PARALLEL:
                    a = a.chunk(world, dim=1)[rank]
                else:
                    b_t = b_t.chunk(world, dim=1)[rank]
            tensors[key] = (a.to(self.dtype).contiguous(), b_t.to(self.dtype).contiguous())
        return tensors

    def forget(self, adapter_id: int) -> None:
        """Drop an unloaded adapter's slot and host copy (its sequences must be gone)."""
        self._slots.evict(adapter_id)
        self._host.discard(adapter_id)
        self._known.pop(adapter_id, None)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
