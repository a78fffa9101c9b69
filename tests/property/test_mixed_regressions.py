"""Plain regression tests for the bugs the mixed-batch fuzzing found, shrunk to a line each.

Each says what the fuzzer drew and what went wrong; they run in milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedinfer import Engine, SamplingParams
from pagedinfer.engine.detokenizer import StopStringMatcher


@pytest.fixture(scope="module")
def engine(make_checkpoint: Callable[..., Path]) -> Iterator[Engine]:
    checkpoint = make_checkpoint("tiny", with_tokenizer=True)
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64) as built:
        yield built


def _piece(engine: Engine) -> tuple[int, str]:
    """A token whose text is printable ASCII of 2+ characters, its last one not repeated."""
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    for token_id in range(1, engine.model_config.vocab_size):
        text = tokenizer.decode([token_id])
        if len(text) >= 2 and text.isascii() and text.isalpha() and text.count(text[-1]) == 1:
            return token_id, text
    raise AssertionError("no suitable token in the tiny tokenizer")


def test_stop_string_within_min_tokens_never_matches_at_the_end(engine: Engine) -> None:
    """Found by test_mixed_batches: min_tokens=max_tokens=1, stop=("t", "in"), the one token
    "pit". The text of the first min_tokens tokens must not end a stop string, but the final
    flush re-searched the held text's tail (longest stop - 1 characters) and matched "t":
    finish_reason "stop", text "pi" instead of "length", "pit"."""
    token, text = _piece(engine)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        min_tokens=1,
        ignore_eos=True,
        allowed_token_ids=[token],
        stop=[text[-1], "\x02\x02"],  # the second only makes the longest stop 2 characters
    )
    (output,) = engine.generate([[token]], params, use_tqdm=False)
    completion = output.outputs[0]
    assert (completion.token_ids, completion.text) == ([token], text)
    assert (completion.finish_reason, completion.stop_reason) == ("length", None)


def test_stop_string_within_min_tokens_never_matches_on_the_next_token(engine: Engine) -> None:
    """The same slip one token later: the first search after min_tokens started inside the
    held text, so a stop string that ended there matched (text cut inside the held part)
    instead of the one the next token completes."""
    token, text = _piece(engine)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=3,
        min_tokens=1,
        ignore_eos=True,
        allowed_token_ids=[token],
        stop=[text[-1], "\x02\x02"],
    )
    (output,) = engine.generate([[token]], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.token_ids == [token, token]
    assert completion.text == text + text[:-1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", text[-1])


def test_stop_string_matcher_matches_only_text_fed_with_checks() -> None:
    """The matcher alone: text fed with check=False holds no match, even when the next feed
    is empty (the final flush) or does not complete any stop string."""
    for later in ("", "x"):
        matcher = StopStringMatcher(["t", "in"])
        assert not matcher.feed("pit", check=False)
        assert not matcher.feed(later), f"a stop string matched inside unchecked text + {later!r}"
        assert matcher.text == "pit" + later and matcher.matched is None
