"""Who runs this step: FCFS scheduling with chunked prefill and preemption by recompute.

Running sequences are in one of two phases: *prefilling* (prompt tokens, or a preempted
sequence's history, still to compute: any number of tokens per step, in chunks) or
*decoding* (one token per step). Two policies share one token budget per step
(``max_num_batched_tokens``) differently (``SchedulerConfig.scheduling_policy``):

* ``"mixed"`` (the default): every step gives every decoding sequence its token (decode
  rows), then spends the rest of the budget on partly prefilled sequences, then on new
  admissions in arrival order (chunked). A step may thus hold decode rows *and* prefill
  chunks (a mixed step); a decoding sequence never waits behind a prefill, only when it
  is preempted. No request is admitted in a step that had to preempt.
* ``"prefill_first"``: a step is either a prefill step (partly prefilled, then new
  sequences) or, when no prefill work can run, a decode step; every decoding sequence waits
  while prompts are prefilled.

The scheduler owns the block pool: it allocates the blocks a step writes before the step
runs and registers full blocks in the prefix cache after it ran (``postprocess``), so a
block is only ever shared once its K/V exist. When a decoding sequence needs a block and
none is free, the newest running sequence is preempted (its blocks freed, recomputed later).

Decode rows are the hot path: their cost is per running sequence, every step. The decoding
sequences live in a :class:`~pagedinfer.domain.decode_batch.DecodeBatch` whose arrays are
moved on in bulk, and the scheduler looks at a single sequence only when something happens
to it. Every decoding sequence advances exactly one token in every step that has decode rows
(a *decode-row step*: a decode or a mixed step), so the step at which its last block fills
up, and the step at which it reaches its length limit, are known when it starts decoding:
the rows file it under those steps in a calendar (counted in decode-row steps) and only
visit the sequences filed under the current step. Sampled stop tokens are found with one set
intersection per step. A mixed step's plan is the decode rows' plan with the prefill chunks
appended (:func:`~pagedinfer.domain.plan.mixed_batch_plan`).

Several completions of one prompt (``SamplingParams.n > 1``) are *forks*: the caller adds the
request's first sequence with the others (:meth:`Scheduler.add`), only the first one
prefills, and the step that computes its last prompt token samples that logits row once per
completion. The forks then start decoding with the prompt's full blocks shared (ref counts)
and a device copy of its partial last block each (``BatchPlan.block_copies``), so the prompt
is computed once for all of them. A fork counts towards ``max_num_seqs`` from its parent's
admission on. If the step that forks is never recorded, the fork is undone and planned again.

The package, one concern per module (map: ``docs/architecture.md``): ``core`` (the loop:
queues, ``schedule``, the two policies, ``postprocess``, preemption, ``finish``), ``config``,
``allocator`` (blocks or ``None``), ``rows`` (the decode rows and their calendar),
``prefill`` (prefill admission: chunks, drafts, lookahead, forks, what waits for a plan in
flight), ``stop_rules``, ``slots`` (sampling slots and their deltas), ``fork_table``
(n > 1), ``verify`` (speculative verify rows, and the decoding policy chosen once: rows or
verify chunks) and ``ahead`` (planned-ahead scheduling). Each answers the loop with a
decision and never calls back into it.
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
