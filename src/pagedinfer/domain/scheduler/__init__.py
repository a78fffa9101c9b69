"""Who runs this step: the scheduler, one concern per module.

:class:`Scheduler` (``core``) is the loop: queues, ``schedule``, the two policies,
``postprocess``, preemption and ``finish``. What it asks of the modules below it, each of
which answers with a decision and never calls back into the loop, is mapped in
``docs/architecture.md``.
"""

from pagedinfer.domain.scheduler.config import (
    SCHEDULING_POLICIES,
    SchedulerConfig,
    SchedulerStats,
    SchedulingPolicy,
)
from pagedinfer.domain.scheduler.core import Scheduler

__all__ = [
    "SCHEDULING_POLICIES",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SchedulingPolicy",
]
