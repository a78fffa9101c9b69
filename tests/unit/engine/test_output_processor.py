"""Output processing (engine/output_processor.py): a step's samples become each request's
news; stop strings, final outputs, aborts, failures and the catch-up after a halfway stop."""

from __future__ import annotations

from typing import Any

import pytest

from pagedinfer.domain.limits import RequestLimits
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.scheduler import Scheduler, SchedulerConfig
from pagedinfer.domain.sequence import FinishReason
from pagedinfer.domain.step_output import StepOutput
from pagedinfer.engine.admission import Admission
from pagedinfer.engine.output_processor import OutputProcessor
from pagedinfer.engine.prompts import TokenizedPrompt
from pagedinfer.engine.request_table import RequestTable
from pagedinfer.engine.requests import OutputSink, RequestState

EOS = 256
A, B, X = ord("a"), ord("b"), ord("x")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """One token per byte (and EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]

    def char(byte: int) -> str:
        return chr(byte) if byte in printable else chr(256 + others.index(byte))

    vocab = {char(byte): byte for byte in range(256)}
    vocab["<|endoftext|>"] = EOS
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    fast: Any = PreTrainedTokenizerFast
    return fast(tokenizer_object=backend, eos_token="<|endoftext|>")


class Parts:
    """A scheduler, the request table, and the processor over them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=16, block_size=4, max_model_len=32, eos_token_ids=frozenset({EOS})
            )
        )
        self.table = RequestTable()
        self.processor = OutputProcessor(self.scheduler, tokenizer, self.table)
        self.admission = Admission(
            limits=RequestLimits(),
            max_running=8,
            vocab_size=EOS + 1,
            eos_token_ids={EOS},
            grammars=None,  # type: ignore[arg-type]  # no structured outputs here
            speculative=False,
        )

    def queue(self, params: SamplingParams, sink: OutputSink, *, streamed: bool = False) -> Any:
        prompt = TokenizedPrompt(None, (X, X))
        return self.admission.enqueue(
            self.table, self.scheduler, self.tokenizer, prompt, params, sink, streamed=streamed
        )

    def step(self, *tokens: int, seconds: float = 1.0) -> None:
        plan = self.scheduler.schedule()
        assert plan is not None
        self.processor.record(plan, StepOutput(list(tokens)), seconds)


@pytest.fixture
def parts(tokenizer: Any) -> Parts:
    return Parts(tokenizer)


def test_a_finished_request_is_handed_over_once_and_forgotten(parts: Parts) -> None:
    sink = OutputSink(wants_progress=False)
    request: RequestState = parts.queue(SamplingParams(max_tokens=2, ignore_eos=True), sink)
    parts.step(A)
    assert not sink.updated and parts.table.requests  # no progress asked for
    parts.step(B)
    [output] = sink.take_outputs()
    assert output.finished and output.outputs[0].text == "ab"
    assert output.outputs[0].finish_reason == "length"
    assert request.final is output
    assert not parts.table.requests and parts.table.num_finished == 1
    assert sink.num_unfinished == 0


def test_progress_goes_to_a_sink_that_wants_it(parts: Parts) -> None:
    sink = OutputSink(wants_progress=True)
    parts.queue(SamplingParams(max_tokens=3, ignore_eos=True), sink, streamed=True)
    parts.step(A)
    [output] = sink.take_outputs()
    assert not output.finished and output.outputs[0].token_ids == [A]


def test_the_steps_are_counted(parts: Parts) -> None:
    parts.queue(SamplingParams(max_tokens=2, ignore_eos=True), OutputSink(wants_progress=False))
    parts.step(A, seconds=2.0)  # the prompt's 2 tokens
    parts.step(B, seconds=0.5)  # one decode row
    counts = parts.processor.accounting
    assert (counts.prompt_tokens, counts.generated_tokens) == (2, 2)
    assert counts.prefill_throughput == pytest.approx(1.0)
    assert counts.decode_throughput == pytest.approx(2 / 0.5)
    assert counts.last_step == (False, 1, 0.5)


def test_a_stop_string_finishes_the_sequence_through_the_scheduler(parts: Parts) -> None:
    sink = OutputSink(wants_progress=False)
    request = parts.queue(SamplingParams(max_tokens=8, stop=["ab"]), sink)
    seq = request.completions[0].seq
    parts.step(A)
    parts.step(B)
    assert seq.finish_reason is FinishReason.STOP and parts.scheduler.get(seq.seq_id) is None
    [output] = sink.take_outputs()
    completion = output.outputs[0]
    assert (completion.finish_reason, completion.stop_reason, completion.text) == (
        "stop",
        "ab",
        "",
    )


def test_a_stop_string_in_the_last_step_wins_over_the_length(parts: Parts) -> None:
    """The scheduler finished the sequence by its length; the stop string matched in the
    same step: the completion reports "stop", and the sequence keeps the scheduler's reason
    (the engine does not rewrite it)."""
    sink = OutputSink(wants_progress=False)
    request = parts.queue(SamplingParams(max_tokens=2, stop=["ab"]), sink)
    parts.step(A)
    parts.step(B)
    assert request.completions[0].seq.finish_reason is FinishReason.LENGTH
    [output] = sink.take_outputs()
    completion = output.outputs[0]
    assert (completion.finish_reason, completion.stop_reason, completion.text) == (
        "stop",
        "ab",
        "",
    )


def test_abort_ends_a_request_in_any_state(parts: Parts) -> None:
    sink = OutputSink(wants_progress=False)
    request = parts.queue(SamplingParams(max_tokens=4, ignore_eos=True), sink)
    parts.step(A)
    assert parts.processor.abort(request.request_id)
    assert not parts.processor.abort(request.request_id)  # already finished
    assert not parts.processor.abort(12345)  # unknown
    [output] = sink.take_outputs()
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert parts.scheduler.pool.num_free_blocks == parts.scheduler.pool.num_blocks


def test_failed_requests_tell_their_sinks(parts: Parts) -> None:
    sink = OutputSink(wants_progress=False)
    request = parts.queue(SamplingParams(max_tokens=4), sink)
    error = RuntimeError("injected")
    parts.processor.fail([request], error, dead=False)
    assert (sink.failed, sink.failure, sink.dead) == ([request.name], error, False)
    assert request.error is error and request.final is not None
    assert not parts.table.requests


def test_catch_up_completes_bookkeeping_that_stopped_halfway(parts: Parts) -> None:
    sink = OutputSink(wants_progress=False)
    request = parts.queue(SamplingParams(max_tokens=4, ignore_eos=True), sink)
    seq = request.completions[0].seq
    with pytest.raises(KeyboardInterrupt), parts.processor.bookkeeping():
        parts.scheduler.finish(seq.seq_id, FinishReason.ABORT)
        raise KeyboardInterrupt  # before the request was finalized
    assert parts.processor.needs_catch_up and parts.table.requests
    parts.processor.catch_up()
    assert not parts.processor.needs_catch_up and not parts.table.requests
    [output] = sink.take_outputs()
    assert output.finished and output.outputs[0].finish_reason == "abort"
