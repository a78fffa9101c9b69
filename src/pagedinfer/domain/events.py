"""What happened to sequences inside the scheduler, as events a caller drains.

A :class:`~pagedinfer.domain.scheduler.Scheduler` created with ``record_events=True`` appends
one event per occurrence, in order, and :meth:`Scheduler.drain_events` hands them over (and
forgets them). Without ``record_events`` nothing is recorded and nothing costs anything.

* :class:`SequencePreempted`: a running sequence gave its blocks back (preemption by
  recompute, in :meth:`Scheduler.schedule`); it waits at the front of the queue and is
  computed again later (from the prefix cache as far as its blocks survive).
* :class:`PrefixCacheHit`: an admission found some of the sequence's leading blocks in the
  prefix cache (in :meth:`Scheduler.schedule`): ``num_cached_tokens`` tokens are not
  computed. ``readmitted`` is True when the sequence was preempted before (it found its own
  earlier blocks).
* :class:`SequenceFinished`: a sequence ended, for whatever reason: EOS, a stop token or a
  length limit in :meth:`Scheduler.postprocess`, :meth:`Scheduler.finish` (a stop string),
  :meth:`Scheduler.abort`, and the completions (``n > 1``) that never started because their
  request ended first (they end with the request's reason). ``seq`` is the finished
  sequence itself (its tokens, ``finish_reason``): after this event
  :meth:`Scheduler.get` no longer knows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from pagedinfer.domain.sequence import FinishReason, Sequence

__all__ = ["PrefixCacheHit", "SchedulerEvent", "SequenceFinished", "SequencePreempted"]


@dataclass(frozen=True, slots=True)
class SequencePreempted:
    """Sequence ``seq_id`` released its blocks; its ``num_tokens`` tokens will be recomputed."""

    seq_id: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PrefixCacheHit:
    """Admitting sequence ``seq_id`` found ``num_cached_tokens`` leading tokens cached."""

    seq_id: int
    num_cached_tokens: int
    readmitted: bool


@dataclass(frozen=True, slots=True)
class SequenceFinished:
    """``seq`` finished with ``reason`` (also ``seq.finish_reason``)."""

    seq: Sequence
    reason: FinishReason

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id


SchedulerEvent: TypeAlias = SequencePreempted | PrefixCacheHit | SequenceFinished
"""Any event the scheduler records; ``match`` on the class or use ``isinstance``."""
