"""The engine's record of each request, and where its outputs go.

A :class:`RequestState` holds one request's completions (one per sequence the scheduler runs
for it; one today, ``n`` once a request can sample several) and the :class:`OutputSink` of
whoever waits for it: a :meth:`~pagedinfer.Engine.stream`, the
:meth:`~pagedinfer.Engine.generate` call that submitted it, or :meth:`~pagedinfer.Engine.step`
for requests queued with ``add_request``. Whichever caller steps the engine, a request's news
goes to its own sink, so each caller returns as soon as its own requests are done.

A request is *finalized* exactly once, when its last completion finishes (stop, length or
abort): its final :class:`RequestOutput` is built then and handed to its sink, never again.
"""

from __future__ import annotations

from typing import Any

from pagedinfer.domain.sequence import Sequence
from pagedinfer.engine.detokenizer import CompletionText
from pagedinfer.engine.outputs import RequestOutput, StreamDelta

__all__ = ["CompletionState", "OutputSink", "RequestState"]


class OutputSink:
    """The requests of one consumer that have news since it last looked.

    ``updated`` keeps one entry per request (outputs are cumulative, so the latest state
    replaces an older one without losing anything), in the order the news first came.
    A sink without ``wants_progress`` records only finished requests.
    """

    __slots__ = ("num_unfinished", "updated", "wants_progress")

    def __init__(self, *, wants_progress: bool) -> None:
        self.wants_progress = wants_progress
        self.updated: dict[int, RequestState] = {}
        self.num_unfinished = 0

    def progressed(self, request: RequestState) -> None:
        if self.wants_progress:
            self.updated[request.request_id] = request

    def finished(self, request: RequestState) -> None:
        self.updated[request.request_id] = request
        self.num_unfinished -= 1

    def take_outputs(self) -> list[RequestOutput]:
        """The news as outputs, oldest first; cleared only once every output is built."""
        outputs = [request.output() for request in self.updated.values()]
        self.updated.clear()
        return outputs


class CompletionState:
    """One sequence of a request: the scheduler owns its tokens, this tracks its text.

    ``text`` is kept up to date every step only when something needs it early (stop
    strings, streaming); otherwise the completion is decoded once, when it finishes.
    """

    __slots__ = (
        "emitted_chars",
        "emitted_tokens",
        "final_text",
        "holdback",
        "num_seen_tokens",
        "request",
        "seq",
        "text",
    )

    def __init__(
        self, request: RequestState, seq: Sequence, tokenizer: Any, *, streamed: bool
    ) -> None:
        self.request = request
        self.seq = seq
        stop = seq.params.stop
        incremental = tokenizer is not None and (streamed or bool(stop))
        self.text = CompletionText(tokenizer, seq.prompt_token_ids, stop) if incremental else None
        self.num_seen_tokens = 0  # completion tokens already fed to ``text``
        self.final_text: str | None = None
        # A streamed delta holds back text that could still turn out to start a stop string.
        self.holdback = max((len(text) for text in stop), default=1) - 1
        self.emitted_tokens = 0
        self.emitted_chars = 0

    def catch_up(self) -> bool:
        """Feed the text tracker the tokens it has not seen; True if a stop string matched."""
        text = self.text
        if text is None:
            return False
        seq = self.seq
        if self.num_seen_tokens < seq.num_completion_tokens:
            new_tokens = seq.token_ids[seq.num_prompt_tokens + self.num_seen_tokens :]
            self.num_seen_tokens = seq.num_completion_tokens
            text.append(new_tokens)
        if seq.is_finished:
            text.flush()  # no token follows: a held-back partial character is final now
        return text.stopped

    def current_text(self) -> str:
        """The text now: final once finished, the tracked text before, else empty."""
        if self.final_text is not None:
            return self.final_text
        if self.text is not None:
            return self.text.text
        return ""

    def finalize_text(self, tokenizer: Any) -> None:
        if tokenizer is None:
            self.final_text = ""
        elif self.text is not None and self.text.stopped:
            self.final_text = self.text.text
        else:
            self.final_text = tokenizer.decode(
                self.seq.completion_token_ids, skip_special_tokens=True
            )


class RequestState:
    """One request: its prompt, its completions, its sink, and its final output once done."""

    __slots__ = ("completions", "final", "prompt", "request_id", "sink")

    def __init__(self, request_id: int, prompt: str | None, sink: OutputSink) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.sink = sink
        self.completions: list[CompletionState] = []
        self.final: RequestOutput | None = None

    @property
    def is_finished(self) -> bool:
        """Every completion has finished (whether the request was finalized yet or not)."""
        return all(completion.seq.is_finished for completion in self.completions)

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

    def stream_delta(self) -> StreamDelta:
        """What is new since the last delta; the final delta once the request is final."""
        # One completion per request until a request can sample several (n > 1).
        completion = self.completions[0]
        seq = completion.seq
        tokens = seq.token_ids[seq.num_prompt_tokens + completion.emitted_tokens :]
        completion.emitted_tokens += len(tokens)
        text = completion.current_text()
        finished = self.final is not None
        end = len(text) if finished else len(text) - completion.holdback
        end = max(end, completion.emitted_chars)
        delta_text = text[completion.emitted_chars : end]
        completion.emitted_chars = end
        reason = seq.finish_reason if finished else None
        return StreamDelta(
            request_id=self.request_id,
            token_ids=tokens,
            text=delta_text,
            finished=finished,
            finish_reason=reason.value if reason is not None else None,
        )

    def _build_output(self, *, finished: bool) -> RequestOutput:
        # One completion per request until a request can sample several (n > 1).
        completion = self.completions[0]
        seq = completion.seq
        reason = seq.finish_reason if finished else None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.completion_token_ids,
            text=completion.current_text(),
            finished=finished,
            finish_reason=reason.value if reason is not None else None,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def __repr__(self) -> str:
        return (
            f"RequestState(id={self.request_id}, finished={self.is_finished}, "
            f"final={self.final is not None})"
        )
