"""``SamplingPipeline``: one step's sampling on the sampling rank, in three calls.

* :meth:`~SamplingPipeline.begin` (before the plan's tensors are packed): settle the records
  of earlier steps (see below) and apply the plan's install / release deltas to the
  :class:`~pagedinfer.adapters.sampling.table.SamplingTable`; its callbacks keep the
  per-request state in step: logits processing (penalties' token counts, bias, masks),
  logprobs requests and structured-output grammar matchers.
* :meth:`~SamplingPipeline.grammar_step` (right after the forward is launched): the
  constrained rows' token bitmask, filled on the host while the device runs the forward.
* :meth:`~SamplingPipeline.sample` (on the step's logits): grammar mask, logprobs (of the
  distribution ``logprobs_mode`` names), processing, the sampler; it records what the step
  changed in the per-request state and starts the copies of the ids (and logprobs) to the
  host. It launches only, and returns the **read**: a callable that waits for those copies
  and gives the step's :class:`SampledTokens`, advancing the grammars by the tokens.

Records: the processing state and the grammars advance at sample time, but the scheduler
may never record a step (it failed, or Ctrl-C came first; async scheduling plans a step
ahead of the previous one's record). A step's changes are kept until a later plan says the
scheduler recorded it (``plan.recorded_step_id``), and undone when a plan shows it never will:
its tokens will be sampled again, so the penalties must not count them twice nor the
grammars advance twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from pagedinfer.adapters.host_transfers import HostUploads, Readbacks
from pagedinfer.adapters.sampling.failed_rows import failed_samples
from pagedinfer.adapters.sampling.grammar import (
    GrammarCompiler,
    GrammarMatchers,
    GrammarStep,
    apply_token_bitmask,
)
from pagedinfer.adapters.sampling.logits_processors import LogitsProcessors, ProcessingStep
from pagedinfer.adapters.sampling.logprobs import (
    LogprobsRequests,
    LogprobsTensors,
    gather_logprobs,
)
from pagedinfer.adapters.sampling.logprobs_mode import (
    DEFAULT_LOGPROBS_MODE,
    LogprobsMode,
    is_processed,
    logprobs_of,
)
from pagedinfer.adapters.sampling.sampler import Sampler
from pagedinfer.adapters.sampling.table import SamplingTable, TableDelta
from pagedinfer.adapters.speculative.verify import accepted_samples
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.step_output import TokenLogprobs

__all__ = ["SampledTokens", "SamplingPipeline", "read_later"]


class SampledTokens(NamedTuple):
    """One step's samples on the host: a token per sample (0 for a failed one), the logprobs
    asked for, and the failed samples by index (see ``StepOutput``)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None
    failed: dict[int, str] | None


@dataclasses.dataclass(slots=True)
class _Record:
    """What sampling step ``step_id`` changed in the per-request state (penalty counts, grammar
    matchers), kept until a later plan says the scheduler recorded that step, or undone when
    a plan shows it never will (:meth:`SamplingPipeline.begin`)."""

    step_id: int
    processing: ProcessingStep | None
    token_ids: torch.Tensor
    kept: torch.Tensor | None
    grammar: GrammarStep | None
    grammar_accepted: bool = False


class SamplingPipeline:
    """The sampling rank's per-slot sampling state and the sampler (see the module docstring).

    ``max_running`` slots (the scheduler's are below it); ``grammars``: the engine's compiler,
    when structured outputs are on. ``uploads`` / ``readbacks``: the runner's host transfers.
    ``logprobs_mode``: what the logprobs of sampled tokens report (``logprobs_mode.py``).
    """

    def __init__(
        self,
        *,
        max_running: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        seed: int,
        uploads: HostUploads,
        readbacks: Readbacks,
        grammars: GrammarCompiler | None = None,
        logprobs_mode: LogprobsMode = DEFAULT_LOGPROBS_MODE,
    ) -> None:
        self.max_running = max_running
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.grammars = grammars
        self.uploads = uploads
        self.readbacks = readbacks
        self.logprobs_mode = logprobs_mode
        self.sampler = Sampler(device, seed)
        # The latest step's sampled ids on the device, by its plan's step_id: the inputs of
        # the rows a plan made ahead of that step carries (BatchPlan.carried_rows).
        self.last_sampled: tuple[int, torch.Tensor] | None = None
        self.table, self.processors, self.logprobs_requests, self.grammar_matchers = (
            self._new_state()
        )
        # Sampling steps whose record by the scheduler is not known yet.
        self._unconfirmed: list[_Record] = []

    def _new_state(
        self,
    ) -> tuple[SamplingTable, LogitsProcessors, LogprobsRequests, GrammarMatchers | None]:
        """The table and the per-request feature state that follows its deltas."""
        table = SamplingTable(self.max_running, self.vocab_size, self.device)
        processors = LogitsProcessors(self.vocab_size, self.device, self.eos_token_ids)
        requests = LogprobsRequests(self.vocab_size)
        table.on_install += [processors.install, requests.install]
        table.on_release += [processors.remove, requests.release]
        matchers = None
        if self.grammars is not None:
            matchers = GrammarMatchers(self.grammars, self.device)
            table.on_install.append(matchers.install)
            table.on_release.append(matchers.release)
        return table, processors, requests, matchers

    def reset(self) -> None:
        """Forget every request (after the warm-up pass); the sampler's generator goes on."""
        self.table, self.processors, self.logprobs_requests, self.grammar_matchers = (
            self._new_state()
        )
        self._unconfirmed = []

    # ------------------------------------------------------------------ the three calls
    def begin(self, plan: BatchPlan) -> TableDelta | None:
        """Settle the records (before the plan's deltas release or reuse any row), then
        apply the plan's deltas to the table; returns the rows it installs (None: none)."""
        if self._unconfirmed:
            self._settle_records(plan)
        return self.table.apply(plan.released_slots, plan.new_requests)

    def grammar_step(self, plan: BatchPlan) -> GrammarStep | None:
        """The constrained rows' token bitmask on the device, or None (no such row)."""
        matchers = self.grammar_matchers
        if matchers is None or not len(matchers) or plan.num_samples == 0:
            return None
        return matchers.fill(plan.sample_slots)

    def sample(
        self,
        plan: BatchPlan,
        logits: torch.Tensor,
        sample_slots: torch.Tensor,
        sample_positions: Callable[[], torch.Tensor],
        grammar: GrammarStep | None = None,
    ) -> Callable[[], SampledTokens]:
        """Sample the step's rows (``logits [num_samples, vocab]``, the table rows
        ``sample_slots`` on the device; ``sample_positions`` gives each sampled row's position
        for seeded rows) and return the read of the results."""
        processors, requests, table = self.processors, self.logprobs_requests, self.table
        if grammar is not None:  # first: logprobs and every later pass see the mask (vLLM's)
            apply_token_bitmask(logits, grammar)
        # Raw logprobs are of the model's distribution (with the grammar's mask, if any):
        # taken before any other processing; processed ones once the step's processing is known.
        wanted = requests.sample_rows(plan.sample_slots)
        mode = self.logprobs_mode
        values = rows = None
        if wanted is not None:
            if len(wanted[0]) < plan.num_samples:
                rows = self.uploads.upload(wanted[0], torch.int64)
            if not is_processed(mode):
                values = logprobs_of(mode, logits if rows is None else logits.index_select(0, rows))
        processing = None
        if len(processors):
            positions, indices = plan.positions, plan.sample_indices
            processing = processors.plan(
                plan.sample_slots,
                lambda j: positions[indices[j]],
                draft_history(plan) if plan.verify_rows else None,
            )
        batch = table.rows(sample_slots, sample_positions() if table.any_seeded else None)
        if wanted is not None and values is None:  # a processed mode: before the sampler
            values = logprobs_of(mode, logits, batch, processors, processing)
            values = values if rows is None else values.index_select(0, rows)
        sampled_ids = self.sampler(logits, batch, processors, processing)  # NO_TOKEN: failed
        token_ids = sampled_ids.clamp(min=0)  # for the state below; failed rows end anyway
        self.last_sampled = (plan.step_id, token_ids)  # what a plan made ahead carries
        record = None
        if processing is not None or grammar is not None:
            kept = accepted_samples(plan, token_ids, self.uploads) if plan.verify_rows else None
            if processing is not None:
                processors.record(processing, token_ids, kept)
            record = _Record(plan.step_id, processing, token_ids, kept, grammar)
            self._unconfirmed.append(record)
        top: Callable[[], LogprobsTensors] | None = None
        if wanted is not None and values is not None:
            chosen = token_ids if rows is None else token_ids.index_select(0, rows)
            top = read_later(self.readbacks, gather_logprobs(values, chosen, max(wanted[1])))
        # The step's one device-to-host wait (more with logprobs), when the output is read:
        # on CUDA a copy into pinned memory queued behind the step, and an event after it.
        readback = self.readbacks.start(token_ids)
        matchers = self.grammar_matchers

        def read() -> SampledTokens:
            sampled = readback.read()  # this step only, not what was launched after it
            if grammar is not None:
                assert matchers is not None and record is not None
                matchers.accept(grammar, sampled)
                record.grammar_accepted = True
            failed = failed_samples(sampled, grammar.failed if grammar is not None else None)
            logprobs: list[TokenLogprobs | None] | None = None
            if top is not None and wanted is not None:
                logprobs = [None] * plan.num_samples
                for row, entry in zip(wanted[0], top().entries(wanted[1]), strict=True):
                    logprobs[row] = entry
            return SampledTokens(sampled, logprobs, failed)

        return read

    # ------------------------------------------------------------------ records
    def _settle_records(self, plan: BatchPlan) -> None:
        """Forget the records of the steps the scheduler recorded (up to
        ``plan.recorded_step_id``), keep the one ``plan`` was made ahead of (still running
        or about to be recorded), and undo the others (see the module docstring)."""
        processors, matchers = self.processors, self.grammar_matchers
        kept: list[_Record] = []
        for record in reversed(self._unconfirmed):  # undo the newest first
            if record.step_id <= plan.recorded_step_id:
                continue
            if plan.made_ahead and record.step_id == plan.step_id - 1:
                kept.append(record)
                continue
            if record.processing is not None:
                processors.record(record.processing, record.token_ids, record.kept, undo=True)
            if record.grammar is not None and record.grammar_accepted and matchers is not None:
                matchers.undo(record.grammar)
        self._unconfirmed = kept[::-1]


def draft_history(plan: BatchPlan) -> dict[int, list[int]]:
    """Speculative decoding: the drafts generated before each verify sample (sample ``i`` of
    a verify row follows its drafts ``0..i-1``), by sample index."""
    history: dict[int, list[int]] = {}
    for _, first, drafts in plan.verify_drafts():
        for i in range(1, len(drafts) + 1):
            history[first + i] = drafts[:i]
    return history


def read_later(readbacks: Readbacks, result: LogprobsTensors) -> Callable[[], LogprobsTensors]:
    """Start the copies of ``result`` to the host now (behind the step, no wait); the
    returned callable waits for them and gives the tensors on the host."""
    ids, logprobs, ranks = (
        readbacks.start(tensor) for tensor in (result.token_ids, result.logprobs, result.ranks)
    )

    def read() -> LogprobsTensors:
        host = LogprobsTensors(ids.wait().clone(), logprobs.wait().clone(), ranks.wait().clone())
        for readback in (ids, logprobs, ranks):
            readback.release()
        return host

    return read
