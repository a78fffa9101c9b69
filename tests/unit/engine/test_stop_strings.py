"""Stop strings match as soon as the text that completes them is final (issue 11.10).

A byte-level BPE token can complete some characters and start a multi-byte one (token
``b\\xc3`` = "b" + the first byte of "é"). Its text up to the unfinished character is final
at once; the detokenizer used to hold back all of it until a later token completed the
character, so a stop string ending in "b" matched one or more tokens late. The tokenizer
here is built by hand so the test controls every byte; the engine test scripts the model's
tokens with a fake executor.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import Engine, SamplingParams
from pagedinfer.domain.executor import launch_now
from pagedinfer.domain.step_output import StepOutput
from pagedinfer.engine.detokenizer import (
    CompletionText,
    IncrementalDetokenizer,
    StopStringMatcher,
)


def _byte_char(byte: int) -> str:
    """The byte-level BPE alphabet's character for ``byte`` (GPT-2's bytes_to_unicode)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


MERGED = _byte_char(ord("b")) + _byte_char(0xC3)  # "b" + the lead byte of "é" (C3 A9)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {_byte_char(byte): byte for byte in range(256)}
    vocab[MERGED] = 256
    vocab["<|endoftext|>"] = 257
    model = models.BPE(vocab=vocab, merges=[(_byte_char(ord("b")), _byte_char(0xC3))])
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    fast: Any = PreTrainedTokenizerFast
    return fast(tokenizer_object=backend, eos_token="<|endoftext|>")


A, B_LEAD, TAIL, X, INVALID = ord("a"), 256, 0xA9, ord("x"), 0xFF  # token ids


def test_the_tokens_are_what_the_test_assumes(tokenizer: Any) -> None:
    assert tokenizer.decode([A, B_LEAD]) == "ab\ufffd"
    assert tokenizer.decode([A, B_LEAD, TAIL]) == "abé"
    assert tokenizer.decode([INVALID, X]) == "\ufffdx"


def test_final_text_is_returned_before_an_unfinished_character(tokenizer: Any) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [X])
    assert detokenizer.append([A]) == "a"
    assert detokenizer.append([B_LEAD]) == "b"  # was "" until the character was complete
    assert detokenizer.append([TAIL]) == "é"
    assert detokenizer.append([X]) == "x"
    assert detokenizer.flush() == ""


def test_only_the_last_replacement_character_waits(tokenizer: Any) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [X])
    assert detokenizer.append([INVALID]) == ""  # 0xFF could (as far as text shows) be a start
    assert detokenizer.append([B_LEAD]) == "\ufffdb"  # a U+FFFD followed by text is final
    assert detokenizer.flush() == "\ufffd"  # no token follows: the unfinished one is final


@pytest.mark.parametrize(
    ("stop", "tokens", "matches_at"),
    [
        ("ab", [A, B_LEAD, TAIL, X], 2),  # completed by a token that also starts "é"
        ("bé", [A, B_LEAD, TAIL, X], 3),  # spans two tokens and a split character
        ("\ufffdb", [INVALID, B_LEAD, X], 2),  # an invalid byte is final once text follows
        ("a", [X, A], 2),
    ],
)
def test_a_stop_string_matches_at_the_token_that_makes_it_final(
    tokenizer: Any, stop: str, tokens: list[int], matches_at: int
) -> None:
    text = CompletionText(tokenizer, [X], [stop])
    matched = [text.append([token]) for token in tokens]
    assert matched.index(True) + 1 == matches_at
    assert stop not in text.text


def test_a_stop_string_in_the_last_unfinished_character_matches_at_the_end(
    tokenizer: Any,
) -> None:
    text = CompletionText(tokenizer, [X], ["b\ufffd"])
    assert not text.append([A]) and not text.append([B_LEAD])
    assert text.flush()  # the request finished: the held-back U+FFFD is final text now
    assert text.text == "a"


class ScriptedExecutor:
    """Samples a fixed script of tokens (the model is not run)."""

    reads_carried_tokens = False
    is_sleeping = False

    def __init__(self, engine: Engine, script: list[int]) -> None:
        self.engine = engine
        self.script = script
        self.num_kv_blocks = engine.scheduler.pool.num_blocks

    def execute(self, plan: Any) -> StepOutput:
        sampled = []
        for seq_id in plan.sampled_seq_ids:
            seq = self.engine.scheduler.get(seq_id)
            assert seq is not None
            sampled.append(self.script[seq.num_completion_tokens])
        return StepOutput(sampled)

    def launch(self, plan: Any) -> Callable[[], StepOutput]:
        return launch_now(self.execute, plan)

    def close(self) -> None:
        pass


@pytest.fixture
def engine(tokenizer: Any, make_checkpoint: Callable[..., Path], tmp_path: Path) -> Any:
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint("tiny"), checkpoint)
    tokenizer.save_pretrained(str(checkpoint))
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64) as engine:
        real = engine._executor
        engine._executor = ScriptedExecutor(engine, [A, B_LEAD, TAIL, X, X, X, X, X])
        yield engine
        engine._executor = real


def test_no_stop_string_may_end_in_the_min_tokens_text() -> None:
    """Found by the mixed-batch fuzzing (issue 21): the first search after the ``min_tokens``
    text started ``longest - 1`` characters back in it, so a shorter stop string lying
    wholly inside that text matched (and ended the request early)."""
    matcher = StopStringMatcher(["abcde", "c"])
    assert not matcher.feed("xxc", check=False)  # within min_tokens
    assert not matcher.feed("y")  # "c" ended in the held text: no match
    assert matcher.feed("cz") and matcher.matched == "c" and matcher.text == "xxcy"
    # A match may start in the held text and end after it; the earliest start wins.
    matcher = StopStringMatcher(["c", "abcde"])
    assert not matcher.feed("xxab", check=False)
    assert matcher.feed("cde") and matcher.matched == "abcde" and matcher.text == "xx"


def test_the_engine_stops_at_the_token_that_completes_the_stop_string(engine: Engine) -> None:
    params = SamplingParams(max_tokens=8, ignore_eos=True, stop=["ab"])
    (output,) = engine.generate([[X]], params, use_tqdm=False)
    assert output.outputs[0].finish_reason == "stop"
    assert output.outputs[0].token_ids == [A, B_LEAD]  # not one token later
    assert output.outputs[0].text == ""
    deltas = list(engine.stream([X], params))
    assert [t for d in deltas for t in d.outputs[0].token_ids] == [A, B_LEAD]
    assert (
        "".join(d.outputs[0].text for d in deltas) == ""
        and deltas[-1].outputs[0].finish_reason == "stop"
    )


def test_text_streams_as_soon_as_it_is_final(engine: Engine) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    deltas = list(engine.stream([X], params))
    assert [d.outputs[0].text for d in deltas] == ["a", "b", "é", "x"]
