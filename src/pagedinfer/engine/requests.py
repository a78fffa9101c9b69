"""The engine's record of each request, and where its outputs go.

A :class:`RequestState` holds one request's completions (one per sequence the scheduler runs
for it: ``SamplingParams.n``) and the :class:`OutputSink` of whoever waits for it: a
:meth:`~pagedinfer.Engine.stream`, the :meth:`~pagedinfer.Engine.generate` call that
submitted it, or :meth:`~pagedinfer.Engine.step` for requests queued with ``add_request``.
Whichever caller steps the engine, a request's news goes to its own sink, so each caller
returns as soon as its own requests are done.

A request is *finalized* exactly once, when its last completion finishes (stop, length or
abort): its final :class:`RequestOutput` is built then and handed to its sink, never again.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pagedinfer.domain.sequence import FinishReason, Sequence
from pagedinfer.domain.step_output import PooledChunk, TokenLogprobs
from pagedinfer.engine.detokenizer import CompletionText, decode_completion
from pagedinfer.engine.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from pagedinfer.engine.pooled import PooledState

__all__ = ["CompletionState", "OutputSink", "RequestState", "logprob_dict", "request_key"]


class OutputSink:
    """The requests of one consumer that have news since it last looked.

    ``updated`` keeps one entry per request (outputs are cumulative, so the latest state
    replaces an older one without losing anything), in the order the news first came.
    A sink without ``wants_progress`` records only finished requests.

    A request ended by a failed step (or by the engine's death) is finished like any other
    (``finish_reason="abort"``) and also listed in ``failed`` with the error, so that its
    consumer raises instead of returning as if nothing happened.
    """

    __slots__ = ("dead", "failed", "failure", "num_unfinished", "updated", "wants_progress")

    def __init__(self, *, wants_progress: bool) -> None:
        self.wants_progress = wants_progress
        self.updated: dict[int, RequestState] = {}
        self.num_unfinished = 0
        self.failed: list[str] = []  # names of requests a failed step ended, not reported yet
        self.failure: BaseException | None = None  # the latest such step's exception
        self.dead = False  # the engine died with requests of this sink unfinished

    def progressed(self, request: RequestState) -> None:
        if self.wants_progress:
            self.updated[request.request_id] = request

    def finished(self, request: RequestState) -> None:
        self.updated[request.request_id] = request
        self.num_unfinished -= 1

    def fail(self, request_id: str, error: BaseException, *, dead: bool) -> None:
        """Request ``request_id`` (its name; finished with "abort") was ended by ``error``."""
        self.failed.append(request_id)
        self.failure = error
        self.dead = self.dead or dead

    def take_outputs(self) -> list[RequestOutput]:
        """The news as outputs, oldest first; cleared only once every output is built."""
        outputs = [request.output() for request in self.updated.values()]
        self.updated.clear()
        return outputs


def logprob_dict(entry: TokenLogprobs, tokenizer: Any) -> dict[int, Logprob]:
    """vLLM's ``{token id: Logprob}``: the top tokens (ranks 1..k), then the chosen token
    with its own rank unless it is among them."""
    top = zip(entry.token_ids[1:], entry.logprobs[1:], strict=True)
    result = {
        token_id: Logprob(logprob, rank, _decode(tokenizer, token_id))
        for rank, (token_id, logprob) in enumerate(top, start=1)
    }
    chosen = entry.token_ids[0]
    if chosen not in result:
        result[chosen] = Logprob(entry.logprobs[0], entry.rank, _decode(tokenizer, chosen))
    return result


def _decode(tokenizer: Any, token_id: int) -> str | None:
    if tokenizer is None:
        return None
    text: str = tokenizer.decode([token_id])
    return text


class CompletionState:
    """One sequence of a request: the scheduler owns its tokens, this tracks its text and
    logprobs.

    ``text`` is kept up to date every step only when something needs it early (stop
    strings, streaming); otherwise the completion is decoded once, when it finishes. Text
    shown before the completion finishes holds back what could still start a stop string.
    """

    __slots__ = (
        "cumulative_logprob",
        "emitted_chars",
        "emitted_finished",
        "emitted_logprobs",
        "emitted_tokens",
        "error",
        "final_text",
        "holdback",
        "index",
        "logprobs",
        "num_seen_tokens",
        "request",
        "seq",
        "shown_chars",
        "surplus_tokens",
        "text",
    )

    def __init__(
        self,
        request: RequestState,
        seq: Sequence,
        tokenizer: Any,
        *,
        streamed: bool,
        index: int = 0,
    ) -> None:
        self.request = request
        self.seq = seq
        self.index = index
        params = seq.params
        stop = params.stop
        incremental = tokenizer is not None and (streamed or bool(stop))
        self.text = (
            CompletionText(
                tokenizer,
                seq.prompt_token_ids,
                stop,
                skip_special_tokens=params.skip_special_tokens,
                include_stop_str=params.include_stop_str_in_output,
            )
            if incremental
            else None
        )
        self.num_seen_tokens = 0  # completion tokens already fed to ``text``
        # Tokens after the one that completed a stop string, got in the same step (a verify
        # row of speculative decoding keeps several): dropped once the sequence is finished.
        self.surplus_tokens = 0
        self.final_text: str | None = None
        # Text shown while running holds back what could still turn out to start a stop string.
        self.holdback = max((len(text) for text in stop), default=1) - 1
        self.shown_chars = 0  # text shown in a cumulative output so far (it never shrinks)
        asked = params.logprobs is not None
        self.logprobs: SampleLogprobs | None = [] if asked else None
        self.cumulative_logprob: float | None = 0.0 if asked else None
        # What the previous stream delta ended with.
        self.emitted_tokens = 0
        self.emitted_chars = 0
        self.emitted_logprobs = 0
        self.emitted_finished = False
        self.error: str | None = None  # why it ended with finish_reason "error"

    def catch_up(self) -> bool:
        """Feed the text tracker the tokens it has not seen; True if a stop string matched.

        No stop string may end within the first ``min_tokens`` tokens (as in vLLM).
        """
        text = self.text
        if text is None:
            return False
        seq = self.seq
        seen = self.num_seen_tokens
        if seen < seq.num_completion_tokens:
            start = seq.num_prompt_tokens + seen
            self.num_seen_tokens = seq.num_completion_tokens
            end = len(seq.token_ids) - self._hidden_stop_tokens()
            held = seq.params.min_tokens - seen  # new tokens still within min_tokens
            if held > 0:
                text.append(seq.token_ids[start : min(start + held, end)], check=False)
                start += held
            if end - start > 1 and seq.params.stop:
                # Several tokens at once: one by one, to know which completed a stop string.
                for index in range(start, end):
                    if text.append(seq.token_ids[index : index + 1]):
                        self.surplus_tokens = len(seq.token_ids) - index - 1
                        break
            elif start < end:
                text.append(seq.token_ids[start:end])
        if seq.is_finished:
            text.flush()  # no token follows: a held-back partial character is final now
        return text.stopped

    def drop_surplus_tokens(self) -> None:
        """Once finished by a stop string: forget the tokens that came after it in the same
        step (and their logprobs), so the completion ends where it would without
        speculation."""
        count = self.surplus_tokens
        seq = self.seq
        if not count or not seq.is_finished:
            return
        self.surplus_tokens = 0
        del seq.token_ids[-count:]
        logprobs = self.logprobs
        if logprobs is not None:
            del logprobs[seq.num_completion_tokens :]
            self.cumulative_logprob = sum(
                entry[token].logprob
                for entry, token in zip(logprobs, seq.completion_token_ids, strict=True)
            )

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why the completion ended (``None`` while it runs): the scheduler's reason, except
        that a stop string matched in the step that also reached ``max_tokens`` wins over the
        length (the sequence is the scheduler's: its reason is not rewritten)."""
        seq = self.seq
        if not seq.is_finished:
            return None
        reason = seq.finish_reason
        if reason is FinishReason.LENGTH and self.text is not None and self.text.stopped:
            return FinishReason.STOP
        return reason

    def _hidden_stop_tokens(self) -> int:
        """1 if the last token ended the completion as a stop token (EOS or a stop id) whose
        text stays out of the output, as in vLLM (``include_stop_str_in_output`` keeps it),
        else 0. Stop strings are matched in the text, so a completion finished with ``stop``
        that no stop string has ended was ended by its last token."""
        seq = self.seq
        stopped_by_string = self.text is not None and self.text.stopped
        if (
            self.finish_reason is FinishReason.STOP
            and not stopped_by_string
            and not seq.params.include_stop_str_in_output
            and seq.num_completion_tokens > 0
        ):
            return 1
        return 0

    def add_logprobs(self, entries: list[TokenLogprobs | None], tokenizer: Any) -> None:
        """The logprobs of the tokens this completion just got: one entry per sample of its
        row, in order (several for a verify row of speculative decoding, whose samples past
        the tokens it kept are dropped)."""
        if self.logprobs is None:
            return
        new = self.seq.num_completion_tokens - len(self.logprobs)
        for entry in entries[: max(new, 0)]:
            if entry is None:
                continue
            self.logprobs.append(logprob_dict(entry, tokenizer))
            assert self.cumulative_logprob is not None
            self.cumulative_logprob += entry.logprobs[0]

    def current_text(self) -> str:
        """The text now: final once finished, else the tracked text held back (or empty)."""
        if self.final_text is not None:
            return self.final_text
        if self.text is None:
            return ""
        text = self.text.text
        if self.seq.is_finished:
            return text  # nothing can follow: no stop string can start in it any more
        end = max(len(text) - self.holdback, self.shown_chars)
        self.shown_chars = end
        return text[:end]

    def finalize_text(self, tokenizer: Any) -> None:
        """The final text: the tracked text if there is one (so a stream's text never
        changes at the end), else the completion decoded the same way, after the prompt."""
        if tokenizer is None:
            self.final_text = ""
        elif self.text is not None:
            self.catch_up()  # an aborted completion was not flushed yet
            self.final_text = self.text.text
        else:
            seq = self.seq
            completion = seq.completion_token_ids
            shown = len(completion) - self._hidden_stop_tokens()
            self.final_text = decode_completion(
                tokenizer,
                seq.prompt_token_ids,
                completion[:shown],
                skip_special_tokens=seq.params.skip_special_tokens,
            )

    def stop_reason(self, eos_token_ids: Collection[int]) -> int | str | None:
        """What ended the completion, as vLLM reports it: the stop string or the stop token
        id; ``None`` for EOS, length, abort, or while running."""
        if self.finish_reason is not FinishReason.STOP:
            return None
        seq = self.seq
        if self.text is not None and self.text.stopped:
            return self.text.matched
        params = seq.params
        last = seq.token_ids[-1]
        if not params.ignore_eos and last in eos_token_ids:
            return None
        return last if last in params.stop_token_ids else None

    def output(self, eos_token_ids: Collection[int]) -> CompletionOutput:
        """Everything so far (cumulative); the finish reason once this completion ended."""
        seq = self.seq
        reason = self.finish_reason
        logprobs = self.logprobs
        return CompletionOutput(
            index=self.index,
            text=self.current_text(),
            token_ids=seq.completion_token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=reason.value if reason is not None else None,
            stop_reason=self.stop_reason(eos_token_ids) if reason is not None else None,
            error=self.error if reason is FinishReason.ERROR else None,
        )

    def delta(self, eos_token_ids: Collection[int]) -> CompletionOutput | None:
        """What is new since the previous delta; ``None`` if nothing is (the delta that
        brings the finish reason comes once)."""
        finished_before = self.emitted_finished
        whole = self.output(eos_token_ids)
        tokens = whole.token_ids[self.emitted_tokens :]
        text = whole.text[self.emitted_chars :]
        if not tokens and not text and (whole.finish_reason is None or finished_before):
            return None
        self.emitted_finished = whole.finish_reason is not None
        self.emitted_tokens = len(whole.token_ids)
        self.emitted_chars = len(whole.text)
        logprobs = None
        if whole.logprobs is not None:
            logprobs = whole.logprobs[self.emitted_logprobs :]
            self.emitted_logprobs = len(whole.logprobs)
        return CompletionOutput(
            index=whole.index,
            text=text,
            token_ids=tokens,
            cumulative_logprob=whole.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=whole.finish_reason,
            stop_reason=whole.stop_reason,
            error=whole.error,
        )


class RequestState:
    """One request: its prompt, its completions, its sink, and its final output once done.

    ``request_id`` is the engine's integer key (its first sequence's id); ``name`` the
    string its outputs carry and callers use (``str(request_id)``).
    """

    __slots__ = (
        "completions",
        "eos_token_ids",
        "error",
        "final",
        "name",
        "pooled",
        "prompt",
        "prompt_logprobs",
        "prompt_logprobs_sent",
        "request_id",
        "sink",
    )

    def __init__(
        self,
        request_id: int,
        prompt: str | None,
        sink: OutputSink,
        *,
        eos_token_ids: Collection[int] = frozenset(),
        num_prompt_tokens: int = 0,
        wants_prompt_logprobs: bool = False,
    ) -> None:
        self.request_id = request_id
        self.name = str(request_id)
        self.prompt = prompt
        self.sink = sink
        self.eos_token_ids = eos_token_ids
        self.completions: list[CompletionState] = []
        self.final: RequestOutput | None = None
        self.error: BaseException | None = None  # what ended it, if a failed step did
        # One entry per prompt token, filled as prefill steps compute them (the first is
        # None: nothing predicts it).
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] * num_prompt_tokens if wants_prompt_logprobs else None
        )
        self.prompt_logprobs_sent = False
        self.pooled: PooledState | None = None  # a pooling model's hidden states (pooled.py)

    def add_pooled(self, chunk: PooledChunk) -> None:
        """A pooling model's rows of one prefill chunk."""
        if self.pooled is None:
            self.pooled = PooledState()
        self.pooled.add(chunk)

    @property
    def is_finished(self) -> bool:
        """Every completion has finished (whether the request was finalized yet or not)."""
        completions = self.completions
        if len(completions) == 1:  # n=1, most requests: spare the generator
            return completions[0].seq.is_finished
        return all(completion.seq.is_finished for completion in completions)

    @property
    def follows_steps(self) -> bool:
        """The request needs news every step, not only when it finishes: its sink shows
        progress, or a completion tracks its text as tokens come (stop strings, streaming)."""
        return self.sink.wants_progress or any(c.text is not None for c in self.completions)

    def set_prompt_logprobs(
        self, first_position: int, entries: list[TokenLogprobs], tokenizer: Any
    ) -> None:
        """Prompt logprobs from a prefill step (a recomputation after preemption repeats
        positions already known: those keep their first value)."""
        known = self.prompt_logprobs
        if known is None:
            return
        for offset, entry in enumerate(entries):
            position = first_position + offset
            if known[position] is None:
                known[position] = logprob_dict(entry, tokenizer)

    def output(self) -> RequestOutput:
        """The final output once finalized, else a snapshot of the progress so far."""
        if self.final is not None:
            return self.final
        return self._build_output(finished=False)

    def finalize(self, tokenizer: Any) -> RequestOutput:
        """Build the final output and hand it to the sink; call once, when finished.

        Building may raise (the tokenizer decodes); the request is final only after.
        """
        assert self.final is None and self.is_finished, self
        for completion in self.completions:
            completion.finalize_text(tokenizer)
        final = self._build_output(finished=True)
        self.final = final
        self.sink.finished(self)
        return final

    def stream_delta(self) -> RequestOutput:
        """What is new since the last delta, shaped like an output: the completions with
        news (tokens, text, logprobs added; finish reason once final), the prompt logprobs
        in the first delta only. The final delta once the request is final."""
        finished = self.final is not None
        outputs = []
        for completion in self.completions:
            delta = completion.delta(self.eos_token_ids)
            if delta is not None:
                outputs.append(delta)
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt_logprobs = list(self.prompt_logprobs)
            self.prompt_logprobs_sent = True
        return self._request_output(prompt_logprobs, outputs, finished)

    def _build_output(self, *, finished: bool) -> RequestOutput:
        outputs = [completion.output(self.eos_token_ids) for completion in self.completions]
        prompt_logprobs = list(self.prompt_logprobs) if self.prompt_logprobs is not None else None
        return self._request_output(prompt_logprobs, outputs, finished)

    def _request_output(
        self,
        prompt_logprobs: PromptLogprobs | None,
        outputs: list[CompletionOutput],
        finished: bool,
    ) -> RequestOutput:
        first = self.completions[0].seq  # the request's first sequence prefilled the prompt
        return RequestOutput(
            request_id=self.name,
            prompt=self.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            pooled=self.pooled.value() if self.pooled is not None and finished else None,
        )

    def __repr__(self) -> str:
        return (
            f"RequestState(id={self.request_id}, finished={self.is_finished}, "
            f"final={self.final is not None})"
        )


def request_key(request_id: str) -> int | None:
    """The engine's key of the request named ``request_id`` (the decimal form of the key),
    or None if no request can have that name."""
    if not isinstance(request_id, str):
        raise TypeError(
            f"request ids are strings (RequestOutput.request_id, what add_request returned), "
            f"got {type(request_id).__name__} {request_id!r}."
        )
    if not (request_id.isascii() and request_id.isdigit()) or len(request_id) > 20:
        return None
    key = int(request_id)
    return key if str(key) == request_id else None  # "01" names no request
