"""Requests that their own input failed during a step: they end with ``"error"``, alone.

A sample fails its request (``StepOutput.failed_samples``) when the request's
structured-output constraint hit a grammar limit or a dead end, or when its logits held no
finite allowed token. That is the request's own doing, not the engine's: the step is good,
its other rows are recorded as usual, and the engine-death counter does not move. Each such
request is finished through the scheduler (``finish_reason="error"``, the step's token for
it discarded, as for an abort while the step ran) with the reason on its completion
(``CompletionOutput.error``), and one log line says which request failed and why.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.scheduler import Scheduler
from pagedinfer.domain.sequence import FinishReason
from pagedinfer.engine.requests import CompletionState

__all__ = ["end_failed_samples"]

_logger = logging.getLogger("pagedinfer.engine")


def end_failed_samples(
    plan: BatchPlan,
    failed_samples: Mapping[int, str],
    completions: Mapping[int, CompletionState],
    scheduler: Scheduler,
) -> list[CompletionState]:
    """Finish each failed sample's sequence with ``"error"`` (before ``plan`` is recorded:
    the scheduler then skips it like a sequence aborted while the step ran); return their
    completions, once each."""
    seq_ids = plan.sampled_seq_ids
    ended: dict[int, CompletionState] = {}
    for index, reason in sorted(failed_samples.items()):
        seq_id = seq_ids[index]
        completion = completions.get(seq_id)
        if completion is None or seq_id in ended or completion.seq.is_finished:
            continue
        scheduler.finish(seq_id, FinishReason.ERROR)
        # Completions still to fork from it (n > 1) end with it, for the same reason.
        for sibling in completion.request.completions:
            seq = sibling.seq
            if seq.finish_reason is FinishReason.ERROR and sibling.error is None:
                sibling.error = reason
                ended[seq.seq_id] = sibling
        _logger.warning(
            "request %s (completion %d) failed: %s",
            completion.request.name,
            completion.index,
            reason,
        )
    return list(ended.values())
