"""Every live request's sampling parameters, by slot: a host mirror and device columns.

The plan names each request by a *slot*, a small integer stable from the request's first step
until it finishes (``domain/plan.py``). Plans carry the requests that are new to the executor
(slot, ``SamplingParams``, prompt length) and the slots released since the previous plan; per
step only ``sample_slots``, the slot of each sampled row. So the per-row parameter lists of the
old plan are gone from the hot loop: this table keeps them, indexed by slot.

* **Host side** (:meth:`SamplingTable.apply`): releases, then installs, idempotently (plans
  repeat their deltas until the scheduler has recorded a step). It keeps counts over the live
  requests (greedy, top-k, top-p, seeded) so the sampler knows on the host which passes it
  needs, without reading the device, and returns the installed rows as a :class:`TableDelta`
  of flat arrays that travel to the device inside the step's one host-to-device copy.
* **Device side**: ``floats [slots, F]`` and ``ints [slots, I]`` (columns below), updated by
  one ``index_copy_`` per dtype on steps that install requests (:meth:`write_rows`), and read
  by one ``index_select`` per dtype for the sampled rows (:meth:`rows`).

Adding a per-request parameter is one column: append it to :data:`FLOAT_COLUMNS` or
:data:`INT_COLUMNS`, fill it in :func:`_row_values`, read it in :meth:`SamplingTable.rows`
(and count it in :class:`_Counts` if the sampler must know on the host whether any row uses
it). ``on_install`` / ``on_release`` callbacks let per-slot structures that are not columns
(logits-processing tables, penalties' token counts) follow the same deltas.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagedinfer.adapters.sampling.batch import NO_SEED, SamplingBatch
from pagedinfer.domain.sampling import SamplingParams

__all__ = [
    "FLOAT_COLUMNS",
    "INT_COLUMNS",
    "NO_SEED",
    "InstalledRequest",
    "SamplingTable",
    "TableDelta",
]

FLOAT_COLUMNS: tuple[str, ...] = ("temperature", "top_p")
INT_COLUMNS: tuple[str, ...] = ("top_k", "seed", "num_prompt_tokens")
_TEMPERATURE, _TOP_P = (FLOAT_COLUMNS.index(name) for name in ("temperature", "top_p"))
_TOP_K, _SEED, _PROMPT = (INT_COLUMNS.index(n) for n in ("top_k", "seed", "num_prompt_tokens"))


class InstalledRequest(Protocol):
    """What a plan says about a request new to the executor (``domain.plan.NewRequest``)."""

    @property
    def seq_id(self) -> int: ...

    @property
    def slot(self) -> int: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def prompt_token_ids(self) -> tuple[int, ...]: ...


def _row_values(params: SamplingParams, num_prompt_tokens: int) -> tuple[list[float], list[int]]:
    """A request's device row: floats in :data:`FLOAT_COLUMNS` order, ints in
    :data:`INT_COLUMNS` order. Greedy requests get temperature 0.0 (the host decides what is
    greedy, with the epsilon; the device mask follows, so the two never disagree)."""
    temperature = 0.0 if params.is_greedy else float(params.temperature)
    seed = NO_SEED if params.seed is None else params.seed
    return [temperature, float(params.top_p)], [params.top_k, seed, num_prompt_tokens]


@dataclass(frozen=True, slots=True)
class TableDelta:
    """Rows to write into the device table: ``slots [d]`` int64, ``floats [d * F]`` float32,
    ``ints [d * I]`` int64 (row-major), as flat arrays ready to be packed for one copy."""

    slots: array[int]
    floats: array[float]
    ints: array[int]

    def __len__(self) -> int:
        return len(self.slots)


@dataclass
class _Counts:
    """How many live requests need each sampler pass (over all slots, not one step's rows:
    a superset is always correct, it only may run a pass a step did not need)."""

    sampled: int = 0  # not greedy
    greedy: int = 0
    top_p: int = 0
    seeded: int = 0
    top_ks: Counter[int] = field(default_factory=Counter)  # k of sampled requests with top-k

    def add(self, params: SamplingParams, sign: int) -> None:
        if params.is_greedy:
            self.greedy += sign
            return
        self.sampled += sign
        self.top_p += sign * (params.top_p < 1.0)
        self.seeded += sign * (params.seed is not None)
        if params.top_k > 0:
            self.top_ks[params.top_k] += sign
            if self.top_ks[params.top_k] == 0:
                del self.top_ks[params.top_k]


@dataclass(frozen=True, slots=True)
class _Live:
    seq_id: int
    params: SamplingParams


class SamplingTable:
    """Sampling parameters of ``num_slots`` slots on ``device`` (see the module docstring)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        self.floats = torch.zeros(num_slots, len(FLOAT_COLUMNS), dtype=torch.float32, device=device)
        self.ints = torch.zeros(num_slots, len(INT_COLUMNS), dtype=torch.int64, device=device)
        self._live: dict[int, _Live] = {}
        self._counts = _Counts()
        self.on_install: list[Callable[[InstalledRequest], None]] = []
        self.on_release: list[Callable[[int], None]] = []

    def __len__(self) -> int:
        """Live requests."""
        return len(self._live)

    @property
    def any_seeded(self) -> bool:
        """Some live sampled request has a seed (its rows need their sample positions)."""
        return self._counts.seeded > 0

    def params(self, slot: int) -> SamplingParams:
        """The parameters installed at ``slot`` (host mirror)."""
        return self._live[slot].params

    # ------------------------------------------------------------------- host side
    def apply(
        self, released: Iterable[int], installed: Iterable[InstalledRequest]
    ) -> TableDelta | None:
        """Apply a plan's deltas on the host: releases first, then installs. Returns the rows
        the device table needs (``None`` if none); pass them to :meth:`write_rows` once they
        are on the device. Idempotent: a request already live at its slot is left alone."""
        live, counts = self._live, self._counts
        for slot in released:
            gone = live.pop(slot, None)
            if gone is not None:
                counts.add(gone.params, -1)
                for callback in self.on_release:
                    callback(slot)
        slots: array[int] | None = None
        floats: array[float] = array("f")
        ints: array[int] = array("q")
        for request in installed:
            slot = request.slot
            current = live.get(slot)
            if current is not None:
                if current.seq_id == request.seq_id:
                    continue  # a repeated delta
                counts.add(current.params, -1)  # a release this table missed: replace
                for release in self.on_release:
                    release(slot)
            assert 0 <= slot < self.num_slots, (slot, self.num_slots)
            live[slot] = _Live(request.seq_id, request.params)
            counts.add(request.params, +1)
            row_floats, row_ints = _row_values(request.params, request.num_prompt_tokens)
            if slots is None:
                slots = array("q")
            slots.append(slot)
            floats.extend(row_floats)
            ints.extend(row_ints)
            for install in self.on_install:
                install(request)
        return None if slots is None else TableDelta(slots, floats, ints)

    # ----------------------------------------------------------------- device side
    def write_rows(self, slots: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor) -> None:
        """Write installed rows (``slots [d]`` int64, ``floats [d, F]``, ``ints [d, I]``), the
        device copy of a :class:`TableDelta`."""
        self.floats.index_copy_(0, slots, floats.view(-1, len(FLOAT_COLUMNS)))
        self.ints.index_copy_(0, slots, ints.view(-1, len(INT_COLUMNS)))

    def rows(
        self, sample_slots: torch.Tensor, sample_positions: torch.Tensor | None
    ) -> SamplingBatch:
        """The sampled rows' parameters (``sample_slots [n]``, a device tensor).

        ``sample_positions [n]`` (the position of each sampled row's last query token) gives
        the seeded rows' sample step, ``position + 1 - num_prompt_tokens``: the number of
        completion tokens before this one, the same after a preemption. Needed only when some
        live request is seeded.
        """
        counts = self._counts
        if counts.sampled == 0:
            return SamplingBatch(all_greedy=True)
        floats = self.floats.index_select(0, sample_slots)
        ints = self.ints.index_select(0, sample_slots)
        any_top_k = bool(counts.top_ks)
        # Over the live sampled requests with top-k on: greedy rows and rows with top-k off
        # are not filtered by top-k, so they do not widen the step's topk.
        max_top_k = min(max(counts.top_ks, default=0), self.vocab_size)
        steps = None
        if counts.seeded:
            assert sample_positions is not None, "seeded rows need their positions"
            steps = sample_positions + 1 - ints[:, _PROMPT]
        return SamplingBatch(
            all_greedy=False,
            any_greedy=counts.greedy > 0,
            any_top_k=any_top_k,
            any_top_p=counts.top_p > 0,
            any_seeded=counts.seeded > 0,
            max_top_k=max_top_k,
            slots=sample_slots,
            temperatures=floats[:, _TEMPERATURE],
            top_ks=ints[:, _TOP_K],
            top_ps=floats[:, _TOP_P],
            seeds=ints[:, _SEED],
            sample_steps=steps,
        )
