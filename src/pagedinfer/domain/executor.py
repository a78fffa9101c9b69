"""The executor contract: what runs a :class:`~pagedinfer.domain.plan.BatchPlan`.

This module is the one place the contract between the scheduler and whatever runs its plans
is written down (docs/architecture.md, "For embedders", and ``examples/`` follow it). The
engine's own executors (``ModelRunner``, the tensor-parallel executor) implement it; so can a
runtime that never imports torch (``examples/numpy_runtime.py``).

The step loop
-------------
::

    plan = scheduler.schedule()                 # None: nothing can run
    output = executor.execute(plan)             # -> StepOutput
    scheduler.postprocess(plan, output.sampled_token_ids)

``execute(plan)`` receives the plan the latest :meth:`Scheduler.schedule` returned. It must,
in this order:

1. apply the sampling-table deltas: ``plan.released_slots`` first, then ``plan.new_requests``
   (install each request's ``SamplingParams`` at its slot);
2. copy the KV blocks of ``plan.block_copies`` (``(source, destination)``, every layer, K and
   V) before the forward pass;
3. store the K/V of every query token at ``plan.slot_mapping[t]`` (skip ``PADDING_SLOT``),
   and attend, row by row, causally to the first ``context_lens[i]`` tokens of the sequence
   through its block table (``plan.block_table(i)``);
4. sample one token per entry of ``plan.sample_indices`` (the logits of that query token),
   with the parameters installed at ``plan.sample_slots[j]``: one entry per completion, so a
   row that forks (``n > 1``) is sampled once per completion (``plan.forks``);
5. compute log-probabilities only for requests that asked (``SamplingParams.logprobs``, and
   ``plan.prompt_logprob_rows`` for ``prompt_logprobs``).

It returns a :class:`~pagedinfer.domain.step_output.StepOutput`: ``sampled_token_ids[j]`` is
the token of sample ``j`` (``plan.sampled_seq_ids[j]`` names its sequence). It must not
modify the plan (its arrays belong to the scheduler's bookkeeping of the step).

Which :class:`~pagedinfer.domain.sampling.SamplingParams` fields the executor applies and
which the scheduler enforces is tabled in that class's docstring: the scheduler decides when a
sequence stops on token ids and lengths; everything that shapes the distribution (temperature,
top-k/p, min-p, penalties, bias, allowed ids, the ``min_tokens`` mask, seeds, structured
outputs) is the executor's.

Failures and the two ways to recover
------------------------------------
``execute`` may raise anything. The scheduler records nothing until :meth:`postprocess`, so a
failed step leaves it consistent: the blocks of the plan stay allocated and nothing is
advanced. The caller then either

* **schedules again** (the engine's way): call :meth:`Scheduler.schedule` without
  postprocessing the failed plan. The unrecorded work is planned again (forks that the plan
  started are undone and forked again; sequences aborted meanwhile are gone). The failed plan
  is dead: postprocessing it afterwards raises ``ValueError``. The engine aborts the requests
  that had a row in the failed step before scheduling again (``engine/failures.py``); an
  embedder may do the same (``scheduler.abort``) or just retry.
* **re-runs the same plan**: call ``execute(plan)`` again and postprocess *that* plan, as long
  as :meth:`Scheduler.schedule` was not called in between. Aborts in between are allowed
  (postprocess skips aborted sequences).

Either way the executor sees some of the plan's work a second time, so everything in a plan
is safe to apply twice: deltas are idempotent (releasing a free slot and re-installing the
same request are no-ops), KV stores write the same values to the same slots, and a block copy
is repeated only before the forward of a plan that carries it (its source is pinned until a
plan that carried it is recorded). Deltas and copies are repeated in every plan until one is
recorded.

When a plan counts as recorded
------------------------------
When ``postprocess(plan, tokens)`` returns (it checks its arguments first, and a plan it
refused is not recorded). State an executor derives from *sampled tokens* (penalty counts, a
grammar's position, a detokenizer) is therefore tentative while the plan is in flight. Every
plan says which plans were recorded: plans are numbered ``plan.step_id`` (1, 2, ...: one number
per :meth:`Scheduler.schedule` call that returned a plan), and ``plan.recorded_step_id`` is the
number of the latest plan recorded before this one was made (0: none). Before running a plan
``P``, keep what was derived from plans numbered up to ``P.recorded_step_id`` and discard what
came from later ones: they were never recorded (a failed step, a Ctrl-C between sampling and
the record, or ``P`` itself on a re-run) and their tokens will be sampled again. The one
exception is a plan made ahead (``P.made_ahead``, below): plan ``P.step_id - 1`` was still
running when ``P`` was made and is recorded after it, so what it derived stays. Discard
before applying ``P``'s deltas, which may hand a released request's rows to another.
An executor whose state depends only on the plan (KV, the sampling table) needs none of this.

Plans made ahead (async scheduling)
-----------------------------------
A caller may plan step N+1 before step N's tokens are back (:meth:`Scheduler.schedule_ahead`,
then ``postprocess(N)``, then ``postprocess(N + 1)``). Such a plan's decode rows named by
``plan.carried_rows`` hold ``PENDING_TOKEN`` in ``input_ids``: their input is sample
``plan.carried_samples[i]`` of plan ``plan.step_id - 1``, which the executor must write in
before the forward (from its device, where the previous step left it), and it must run plans
in the order they were made. An executor that cannot leaves it to its caller: the engine then
fills the tokens in on the host once the previous step returned (each of the engine's
executors says which: ``ModelExecutor.reads_carried_tokens``; ``ModelRunner`` reads them).
A row of a sequence that finished at step N is still computed in step N+1; the scheduler
discards its token.

Threads: the scheduler is not thread-safe (one thread at a time, or a lock around it, as the
engine does); ``execute`` may run without that lock, since it only reads the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.step_output import StepOutput

__all__ = ["Executor", "launch_now"]


class Executor(Protocol):
    """Runs one :class:`BatchPlan` and samples (the contract is this module's docstring)."""

    def execute(self, plan: BatchPlan) -> StepOutput:
        """Run ``plan``: apply its deltas and block copies, store K/V at ``slot_mapping``,
        attend through the block tables, and return one sampled token per entry of
        ``plan.sample_indices`` (plus the log-probabilities requests asked for). May raise;
        see the module docstring for what the caller does then."""
        ...


def launch_now(
    execute: Callable[[BatchPlan], StepOutput], plan: BatchPlan
) -> Callable[[], StepOutput]:
    """``launch`` (the engine's executors split a step in two: start it, later read its
    output) for an executor that does not overlap steps: ``execute(plan)`` now, and a
    callable that hands its output back."""
    output = execute(plan)

    def read_output() -> StepOutput:
        return output

    return read_output
