"""The host KV tier's memory and its copies (the index: :mod:`pagedinfer.domain.host_tier`).

``kv_offloading_size`` bytes of host memory hold ``num_slots`` blocks, slot-major
(``[num_slots, 2, num_layers, block_size, kv_heads, head_dim]``: one slot is contiguous, so a
block moves as one memcpy per side). A plan's ``kv_copies_out`` (device block -> slot) and
``kv_copies_in`` (slot -> device block) run in :meth:`HostKVTier.transfer`, before the step's
forward, copies out first:

* **CUDA**: pinned memory and a side stream. The side stream first waits for the work queued
  so far (the blocks it copies out were written by earlier steps), then copies. The step's
  stream waits (on the device, never on the host) for the copies out, because the step may
  overwrite an evicted block; the copies in are needed only by a *later* step (the scheduler
  counts them as computed once their plan is recorded), so the next :meth:`transfer` or
  :meth:`before_step` makes the step's stream wait for them: they overlap with this step.
* **CPU**: a separate tensor pool; the copies are plain ``index_copy_`` calls in the step
  (host and "device" share memory: the tier costs a memcpy each way, no transfer over a bus).
"""

from __future__ import annotations

import time

import torch

from pagedinfer.adapters.kv_cache import is_fp8
from pagedinfer.errors import ConfigurationError

__all__ = ["HostKVTier", "host_kv_tier"]


def host_kv_tier(kv_cache: torch.Tensor, num_bytes: int) -> HostKVTier | None:
    """The tier for ``num_bytes`` of host memory behind ``kv_cache`` (``None`` for 0)."""
    if num_bytes <= 0:
        return None
    block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
    num_slots = num_bytes // block_bytes
    if num_slots < 1:
        raise ConfigurationError(
            f"kv_offloading_size holds {num_bytes} bytes but one KV block takes {block_bytes}: "
            "the host tier would hold no block. Give it at least one block's bytes "
            f"({block_bytes / (1 << 30):.6f} GiB), or leave it unset."
        )
    return HostKVTier(kv_cache, num_slots)


class HostKVTier:
    """``num_slots`` blocks of host memory shaped like one block of ``kv_cache`` each."""

    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        self.num_slots = num_slots
        self.device = kv_cache.device
        two, num_layers, _, block_size, kv_heads, head_dim = kv_cache.shape
        shape = (num_slots, two, num_layers, block_size, kv_heads, head_dim)
        on_cuda = self.device.type == "cuda"
        self.storage = torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=on_cuda)
        self.block_bytes = self.storage[0].numel() * self.storage.element_size() if num_slots else 0
        self._stream = torch.cuda.Stream(self.device) if on_cuda else None  # type: ignore[no-untyped-call]
        self._loads_done: torch.cuda.Event | None = None  # copies in the next step waits for
        self.copy_seconds = 0.0  # host time spent issuing (CUDA) or running (CPU) copies
        self.blocks_out = 0
        self.blocks_in = 0

    def before_step(self) -> None:
        """Make the step about to launch wait (on the device) for the copies in before it."""
        if self._loads_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loads_done)
            self._loads_done = None

    def transfer(
        self,
        kv_cache: torch.Tensor,
        copies_out: tuple[tuple[int, int], ...],
        copies_in: tuple[tuple[int, int], ...],
    ) -> None:
        """Run a plan's copies between ``kv_cache`` and the host slots: out, then in."""
        started = time.perf_counter()
        cache = kv_cache.view(torch.uint8) if is_fp8(kv_cache.dtype) else kv_cache
        storage = self.storage.view(torch.uint8) if is_fp8(kv_cache.dtype) else self.storage
        if self._stream is None:
            _copy_on_cpu(cache, storage, copies_out, copies_in)
        else:
            self._copy_on_cuda(cache, storage, copies_out, copies_in)
        self.blocks_out += len(copies_out)
        self.blocks_in += len(copies_in)
        self.copy_seconds += time.perf_counter() - started

    def _copy_on_cuda(
        self,
        cache: torch.Tensor,
        storage: torch.Tensor,
        copies_out: tuple[tuple[int, int], ...],
        copies_in: tuple[tuple[int, int], ...],
    ) -> None:
        stream = self._stream
        assert stream is not None
        main = torch.cuda.current_stream(self.device)
        stream.wait_stream(main)  # what earlier steps wrote, and earlier copies' order
        with torch.cuda.stream(stream):
            for block, slot in copies_out:
                storage[slot].copy_(cache[:, :, block], non_blocking=True)
            if copies_out:
                main.wait_stream(stream)  # this step may overwrite the evicted blocks
            for slot, block in copies_in:
                cache[:, :, block].copy_(storage[slot], non_blocking=True)
            if copies_in:
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(stream)
                self._loads_done = done

    def close(self) -> None:
        self.storage = torch.empty(0)
        self._stream = None
        self._loads_done = None


def _copy_on_cpu(
    cache: torch.Tensor,
    storage: torch.Tensor,
    copies_out: tuple[tuple[int, int], ...],
    copies_in: tuple[tuple[int, int], ...],
) -> None:
    if copies_out:
        blocks = torch.tensor([block for block, _ in copies_out])
        slots = torch.tensor([slot for _, slot in copies_out])
        storage.index_copy_(0, slots, cache.index_select(2, blocks).movedim(2, 0))
    if copies_in:
        slots = torch.tensor([slot for slot, _ in copies_in])
        blocks = torch.tensor([block for _, block in copies_in])
        cache.index_copy_(2, blocks, storage.index_select(0, slots).movedim(0, 2))
