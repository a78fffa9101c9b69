"""Which adapter sits in which device slot, and the host copies of recent adapters.

:class:`SlotAssignment` maps adapter ids to the ``max_loras`` device slots: a step's adapters
keep their slots; an adapter that has none takes a free slot or the least recently used one
that this step does not need (the scheduler never puts more adapters in a step than there are
slots: :mod:`pagedinfer.domain.scheduler.adapter_limit`). :class:`HostCache` keeps the
``max_cpu_loras`` most recently used adapters' tensors in host memory, so an adapter that
lost its slot comes back without reading its files again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Generic, TypeVar

__all__ = ["HostCache", "SlotAssignment"]

T = TypeVar("T")


class SlotAssignment:
    """Adapter id -> device slot, least recently used first."""

    __slots__ = ("_by_adapter", "num_slots")

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._by_adapter: OrderedDict[int, int] = OrderedDict()

    def slot_of(self, adapter_id: int) -> int | None:
        return self._by_adapter.get(adapter_id)

    def assign(self, needed: Collection[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for the adapters ``needed`` by one step: ``(adapter id -> slot, [(slot,
        adapter id) to load])``. Raises ``RuntimeError`` for more adapters than slots."""
        if len(needed) > self.num_slots:
            raise RuntimeError(
                f"a step holds {len(needed)} LoRA adapters but there are {self.num_slots} "
                "device slots (max_loras): the scheduler must not plan such a step."
            )
        by_adapter = self._by_adapter
        for adapter_id in needed:
            if adapter_id in by_adapter:
                by_adapter.move_to_end(adapter_id)
        used = set(by_adapter.values())
        free = [slot for slot in range(self.num_slots) if slot not in used]
        loads: list[tuple[int, int]] = []
        for adapter_id in needed:
            if adapter_id in by_adapter:
                continue
            if free:
                slot = free.pop(0)
            else:  # evict the least recently used adapter this step does not need
                victim = next(held for held in by_adapter if held not in needed)
                slot = by_adapter.pop(victim)
            by_adapter[adapter_id] = slot
            loads.append((slot, adapter_id))
        return {adapter_id: by_adapter[adapter_id] for adapter_id in needed}, loads

    def evict(self, adapter_id: int) -> int | None:
        """Forget ``adapter_id``'s slot (unloaded); the slot it held, if any."""
        return self._by_adapter.pop(adapter_id, None)


class HostCache(Generic[T]):
    """The ``capacity`` most recently used values by key, loaded on a miss."""

    __slots__ = ("_values", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._values: OrderedDict[int, T] = OrderedDict()

    def get(self, key: int, load: Callable[[], T]) -> T:
        values = self._values
        if key in values:
            values.move_to_end(key)
            return values[key]
        value = load()
        values[key] = value
        while len(values) > self.capacity:
            values.popitem(last=False)
        return value

    def discard(self, key: int) -> None:
        self._values.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._values
