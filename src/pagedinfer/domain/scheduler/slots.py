"""Sampling slots and the deltas that tell the executor about them.

A slot is a request's row in the executor's sampling table, from its first step until it
finishes (:mod:`pagedinfer.domain.plan`). :class:`SlotTable` hands slots out and takes them
back, and keeps the deltas (requests to install, slots released) that every plan repeats
until a plan that carried them is recorded.
"""

from __future__ import annotations

from pagedinfer.domain.plan import BatchPlan, NewRequest, needs_prompt_tokens
from pagedinfer.domain.sequence import Sequence

__all__ = ["SlotTable"]


class SlotTable:
    """The slots of one scheduler: the lowest numbers, reused once released."""

    __slots__ = ("free", "new_requests", "num_slots", "released")

    def __init__(self) -> None:
        self.free: list[int] = []
        self.num_slots = 0
        self.new_requests: list[NewRequest] = []  # to install: not confirmed yet
        self.released: list[int] = []  # to release: not confirmed yet

    def assign(self, seq: Sequence) -> None:
        """Give ``seq`` a slot and queue its installation."""
        if self.free:
            seq.slot = self.free.pop()
        else:
            seq.slot = self.num_slots
            self.num_slots += 1
        prompt = tuple(seq.prompt_token_ids) if needs_prompt_tokens(seq.params) else ()
        self.new_requests.append(
            NewRequest(seq.seq_id, seq.slot, seq.params, seq.num_prompt_tokens, prompt, seq.lora)
        )

    def release(self, seq: Sequence) -> None:
        """Take ``seq``'s slot back (if it holds one) and queue its release."""
        slot = seq.slot
        if slot < 0:
            return
        seq.slot = -1
        self.free.append(slot)
        # Not installed yet (as far as we know): no need to. The release still goes out, in
        # case the executor did install it.
        self.new_requests = [r for r in self.new_requests if r.slot != slot]
        self.released.append(slot)

    def unconfirmed(
        self, ahead: BatchPlan | None
    ) -> tuple[tuple[int, ...], tuple[NewRequest, ...]]:
        """``(released_slots, new_requests)`` for the next plan: those not confirmed yet,
        less those ``ahead`` (the plan in flight, planning ahead of it) carries."""
        released = tuple(self.released)
        new_requests = tuple(self.new_requests)
        if ahead is not None:
            released = released[len(ahead.released_slots) :]
            if ahead.new_requests:
                sent = {id(request) for request in ahead.new_requests}
                new_requests = tuple(r for r in new_requests if id(r) not in sent)
        return released, new_requests

    def confirm(self, plan: BatchPlan) -> None:
        """``plan`` ran: the executor applied its deltas."""
        if plan.released_slots:
            del self.released[: len(plan.released_slots)]
        if plan.new_requests:
            sent = {id(request) for request in plan.new_requests}
            self.new_requests = [r for r in self.new_requests if id(r) not in sent]

    def check(
        self, running: list[Sequence], waiting: list[Sequence], forking: list[Sequence], limit: int
    ) -> None:
        """Raise ``AssertionError`` unless the holders' slots and the free ones are exactly
        ``0 .. num_slots - 1`` (at most ``limit``) and every running request holds one."""
        holders = [seq for seq in [*running, *waiting, *forking] if seq.slot >= 0]
        slots = [seq.slot for seq in holders]
        if len(set(slots)) != len(slots):
            raise AssertionError(f"two requests share a sampling slot: {slots}")
        if any(seq.slot < 0 for seq in running):
            raise AssertionError("a running request has no sampling slot")
        if any(seq.slot >= 0 and seq.num_preemptions == 0 for seq in waiting):
            raise AssertionError("a request that never ran holds a sampling slot")
        if sorted(slots + self.free) != list(range(self.num_slots)):
            raise AssertionError(f"slots {slots} + free {self.free} != 0..{self.num_slots}")
        if self.num_slots > limit:
            raise AssertionError(f"{self.num_slots} slots > max_running {limit}")
