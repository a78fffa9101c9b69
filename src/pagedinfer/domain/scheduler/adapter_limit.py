"""The LoRA policy of the scheduler: never more distinct adapters in a step than slots.

The executor holds ``max_loras`` adapters on the device at once (its slots); every running
sequence has a row in each decode step, so the rule is kept at admission: a waiting sequence
whose adapter is not among the running sequences' is admitted only while fewer than
``max_loras`` distinct adapters run. The queue stays first-come first-served: such a
sequence at the head waits (and the ones behind it with it) until an adapter's last
sequence leaves. Sequences of the base model (``lora is None``) never count.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedinfer.domain.sequence import Sequence

__all__ = ["AdapterLimit", "running_adapters"]


def running_adapters(seqs: Iterable[Sequence]) -> set[int]:
    """The distinct adapter ids of ``seqs`` (the base model is not one)."""
    return {seq.lora.lora_int_id for seq in seqs if seq.lora is not None}


class AdapterLimit:
    """At most ``max_loras`` distinct adapters among the running sequences (0: no adapters
    are served, and none is admitted)."""

    __slots__ = ("max_loras",)

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras

    def admits(self, seq: Sequence, active: set[int]) -> bool:
        """Whether ``seq`` may join running sequences whose adapters are ``active``."""
        lora = seq.lora
        if lora is None or lora.lora_int_id in active:
            return True
        return len(active) < self.max_loras

    def check(self, running: Iterable[Sequence]) -> None:
        """Raise ``AssertionError`` if the running sequences hold too many adapters."""
        active = running_adapters(running)
        if len(active) > self.max_loras:
            raise AssertionError(
                f"{len(active)} adapters run ({sorted(active)}), max_loras={self.max_loras}"
            )
