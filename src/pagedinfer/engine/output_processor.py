"""Output processing: a step's samples become each request's news.

:meth:`OutputProcessor.record` takes a step's output after the executor returned it: prompt
logprobs and logprobs go to their completions, samples that failed their request end it
(``failed_requests.py``), the scheduler records the tokens, speculative decoding gets its
next drafts, and the step's counts go to :class:`~pagedinfer.engine.stats.StepAccounting`.
Then each completion's text catches up and stop strings are matched (a match finishes the
sequence through the scheduler), and every request with news tells its sink: progress, or
its final output (:meth:`OutputProcessor.finalize`), after which the request is forgotten.
:meth:`OutputProcessor.abort` ends a request in any state.

Bookkeeping that belongs together runs inside :meth:`OutputProcessor.bookkeeping`: if it
raises halfway (a tokenizer error, Ctrl-C), :meth:`OutputProcessor.catch_up` completes it on
the engine's next call, so nothing is orphaned and nothing is reported twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.scheduler import Scheduler
from pagedinfer.domain.sequence import FinishReason, SequenceStatus
from pagedinfer.domain.sequence import Sequence as DomainSequence
from pagedinfer.domain.speculative import SpeculativeConfig
from pagedinfer.domain.step_output import StepOutput, TokenLogprobs
from pagedinfer.engine.failed_requests import end_failed_samples
from pagedinfer.engine.request_table import RequestTable
from pagedinfer.engine.requests import CompletionState, RequestState
from pagedinfer.engine.stats import StepAccounting

__all__ = ["OutputProcessor"]


class OutputProcessor:
    """Records steps and hands their news to the requests' sinks (under the engine's lock)."""

    def __init__(self, scheduler: Scheduler, tokenizer: Any, table: RequestTable) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.table = table
        self.accounting = StepAccounting()
        # A step's bookkeeping stopped halfway (an exception): catch_up completes it.
        self.needs_catch_up = False

    # ------------------------------------------------------------------ record
    def record(
        self,
        plan: BatchPlan,
        output: StepOutput,
        seconds: float,
        speculation: SpeculativeConfig | None = None,
    ) -> None:
        """Record ``plan``'s step, which returned ``output`` after ``seconds``; with
        ``speculation``, propose the next drafts of the sequences that got tokens."""
        sampled = output.sampled_token_ids
        self.accounting.add(plan, len(sampled), seconds)
        completions = self.table.completions
        scheduler = self.scheduler
        with self.bookkeeping():
            for chunk in output.prompt_logprobs:
                owner = completions.get(chunk.seq_id)
                if owner is not None:
                    owner.request.set_prompt_logprobs(
                        chunk.first_position, chunk.entries, self.tokenizer
                    )
            for pooled in output.pooled:  # a pooling model's hidden states
                owner = completions.get(pooled.seq_id)
                if owner is not None:
                    owner.request.add_pooled(pooled)
            logprobs: dict[int, list[TokenLogprobs | None]] | None = None
            if output.logprobs is not None:
                logprobs = {}
                for seq_id, entry in zip(plan.sampled_seq_ids, output.logprobs, strict=True):
                    logprobs.setdefault(seq_id, []).append(entry)
            accepted = scheduler.num_accepted_tokens
            failed = None
            if output.failed_samples:  # their own input failed them: they end, nothing else
                failed = end_failed_samples(plan, output.failed_samples, completions, scheduler)
            seqs = scheduler.postprocess(plan, sampled)
            if failed:
                self.update(failed)
            if plan.verify_rows:  # samples after a rejected draft are not generated tokens
                drafts = sum(count for _, _, count in plan.verify_rows)
                self.accounting.discount(drafts - (scheduler.num_accepted_tokens - accepted))
            if speculation is not None:
                self._propose(speculation, seqs, output.draft_token_ids)
            if logprobs is None and not self.table.num_following:
                self._finalize_finished(seqs)
                return
            updated = [completions[seq.seq_id] for seq in seqs]
            if logprobs is not None:
                for completion in updated:
                    entries = logprobs.get(completion.seq.seq_id)
                    if entries is not None:
                        completion.add_logprobs(entries, self.tokenizer)
            self.update(updated)

    def _propose(
        self,
        speculation: SpeculativeConfig,
        seqs: list[DomainSequence],
        drafted: Mapping[int, list[int]] | None,
    ) -> None:
        """Speculative decoding: drafts for the sequences that just got tokens: the draft
        model's (proposed in the step, ``drafted``), or the n-gram lookup over their tokens."""
        scheduler = self.scheduler
        running = SequenceStatus.RUNNING
        k = speculation.num_speculative_tokens
        for seq in seqs:
            if seq.status is running and seq.num_uncomputed_tokens == 1:
                if drafted is not None:
                    drafts = drafted.get(seq.seq_id, [])
                elif speculation.method == "ngram":
                    drafts = speculation.propose(seq.token_ids, k)
                else:
                    continue
                scheduler.set_drafts(seq.seq_id, drafts)

    def _finalize_finished(self, seqs: list[DomainSequence]) -> None:
        """:meth:`update` when no request follows every step (no text is tracked, no sink
        shows progress): only requests whose last sequence just finished have news."""
        finished = SequenceStatus.FINISHED
        completions = self.table.completions
        for seq in [seq for seq in seqs if seq.status is finished]:
            completion = completions.get(seq.seq_id)
            # None: its request was finalized by a sibling that finished in this step.
            if completion is not None and completion.request.is_finished:
                self.finalize(completion.request)

    # ------------------------------------------------------------------ news
    def update(self, completions: list[CompletionState]) -> None:
        """After new tokens: stop strings (every completion first), then news for each
        request's sink (or its final output)."""
        for completion in completions:
            seq = completion.seq
            if completion.text is not None and completion.catch_up():  # a stop string matched
                if not seq.is_finished:
                    self.scheduler.finish(seq.seq_id, FinishReason.STOP)
                # Finished by its length in the same step, it reports "stop": the stop
                # string wins (CompletionState.finish_reason).
                completion.drop_surplus_tokens()
        requests = {id(c.request): c.request for c in completions}  # in order, once each
        for request in requests.values():
            if request.is_finished:
                self.finalize(request)
            else:
                request.sink.progressed(request)

    def finalize(self, request: RequestState) -> None:
        """Hand the request's final output to its sink (once), then forget the request."""
        if request.final is None:
            request.finalize(self.tokenizer)
        self.table.forget(request)

    def abort(self, request_id: int) -> bool:
        """End request ``request_id`` now (``"abort"``, its blocks freed) and hand over its
        final output; False if it is unknown or already finished."""
        request = self.table.requests.get(request_id)
        if request is None:
            return False
        with self.bookkeeping():
            for completion in request.completions:
                if not completion.seq.is_finished:
                    self.scheduler.abort(completion.seq.seq_id)
            self.finalize(request)
        return True

    def fail(self, requests: list[RequestState], error: BaseException, *, dead: bool) -> None:
        """End ``requests`` (``"abort"``) because a step failed with ``error`` (``dead``: the
        engine died of it); their sinks raise it to whoever waits for them."""
        for request in requests:
            request.error = error
            request.sink.fail(request.name, error, dead=dead)
            self.abort(request.request_id)

    # -------------------------------------------------------------- bookkeeping
    @contextlib.contextmanager
    def bookkeeping(self) -> Iterator[None]:
        """Marks changes that belong together: if one raises halfway, :meth:`catch_up`
        ends it."""
        outer = self.needs_catch_up
        self.needs_catch_up = True
        yield
        self.needs_catch_up = outer  # not reached if the body raised

    def catch_up(self) -> None:
        """Complete bookkeeping that raised halfway: every request sees its tokens;
        requests that the scheduler finished are finalized and forgotten."""
        if not self.needs_catch_up:
            return
        pending = []
        for completion in list(self.table.completions.values()):
            if completion.request.final is not None:
                self.finalize(completion.request)  # only forgetting it was left
            else:
                pending.append(completion)
        self.update(pending)
        self.needs_catch_up = False
