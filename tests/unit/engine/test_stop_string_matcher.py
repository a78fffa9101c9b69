"""The stop-string rules on their own, without a model: ``StopStringMatcher`` (which stop
wins, where the text is cut, text that may not end a match) and the incremental detokenizer
it reads from, driven by a byte-level tokenizer written here (token id = one byte)."""

from __future__ import annotations

import pytest

from pagedinfer.engine.detokenizer import (
    CompletionText,
    IncrementalDetokenizer,
    StopStringMatcher,
    decode_completion,
)


class ByteTokenizer:
    """Token id = one UTF-8 byte; id 256 is a special token ("<eos>")."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        pending = bytearray()
        for token in token_ids:
            if token == 256:
                parts.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                parts.append("" if skip_special_tokens else "<eos>")
            else:
                pending.append(token)
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)


def ids(text: str) -> list[int]:
    return list(text.encode())


TOKENIZER = ByteTokenizer()


# ------------------------------------------------------------------ StopStringMatcher
def test_the_text_is_cut_before_the_stop_or_after_it_when_included() -> None:
    dropped = StopStringMatcher(["cd"])
    assert not dropped.feed("ab")
    assert dropped.feed("cdef")
    assert (dropped.text, dropped.matched) == ("ab", "cd")
    kept = StopStringMatcher(["cd"], include_stop_str=True)
    assert kept.feed("abcdef")
    assert (kept.text, kept.matched) == ("abcd", "cd")


def test_the_earliest_stop_in_the_text_wins_then_the_first_listed() -> None:
    matcher = StopStringMatcher(["zz", "de", "cd"])
    assert matcher.feed("abcdezz")
    assert (matcher.text, matcher.matched) == ("ab", "cd")
    tie = StopStringMatcher(["ab", "a"])  # both start at 1: the first listed
    assert tie.feed("xab")
    assert (tie.text, tie.matched) == ("x", "ab")
    tie = StopStringMatcher(["a", "ab"])
    assert tie.feed("xab")
    assert (tie.text, tie.matched) == ("x", "a")


@pytest.mark.parametrize(
    "deltas",
    [["xxab", "c"], ["xxa", "bc"], ["x", "x", "a", "b", "c"], ["xxabc"], ["xx", "", "abc"]],
)
def test_a_stop_split_across_deltas_matches(deltas: list[str]) -> None:
    matcher = StopStringMatcher(["abc", "q"])
    matched = [matcher.feed(delta) for delta in deltas]
    assert matched == [False] * (len(deltas) - 1) + [True]
    assert (matcher.text, matcher.matched) == ("xx", "abc")


def test_text_fed_unchecked_never_ends_a_match_but_may_start_one() -> None:
    matcher = StopStringMatcher(["ab", "bc"])
    assert not matcher.feed("xab", check=False)  # within min_tokens: "ab" may not end here
    assert not matcher.feed("x")  # nor be found later
    assert matcher.text == "xabx" and matcher.matched is None
    assert not matcher.feed("b", check=False)
    assert matcher.feed("c")  # "bc" starts in unchecked text and ends in checked text
    assert (matcher.text, matcher.matched) == ("xabx", "bc")


def test_a_longer_stop_keeps_a_longer_tail_searchable() -> None:
    matcher = StopStringMatcher(["a", "wxyz"])
    assert not matcher.feed("0wxy", check=False)
    assert matcher.feed("z")
    assert (matcher.text, matcher.matched) == ("0", "wxyz")


def test_no_stop_strings_never_match() -> None:
    matcher = StopStringMatcher([])
    assert not matcher.feed("anything at all")
    assert matcher.text == "anything at all" and matcher.matched is None


# ---------------------------------------------------------------- the detokenizer
def test_streamed_text_is_the_whole_text_and_never_shows_a_half_character() -> None:
    text = "héllo wörld: ✓ 😀 done"
    detokenizer = IncrementalDetokenizer(TOKENIZER, ids("> "))
    deltas = [detokenizer.append([byte]) for byte in ids(text)]
    assert "".join(deltas) + detokenizer.flush() == text
    assert all("\ufffd" not in delta for delta in deltas)
    # A character's text comes with its last byte; its other bytes add nothing.
    assert [len(delta) for delta in deltas] == [
        1 if (i + 1 == len(ids(text)) or ids(text)[i + 1] < 0x80 or ids(text)[i + 1] >= 0xC0) else 0
        for i in range(len(ids(text)))
    ]


def test_long_completions_stream_the_same_text() -> None:
    text = ("ab é " * 80).strip()  # hundreds of tokens: the window is trimmed on the way
    detokenizer = IncrementalDetokenizer(TOKENIZER, ids("prompt"))
    streamed = "".join(detokenizer.append([byte]) for byte in ids(text)) + detokenizer.flush()
    assert streamed == text
    chunked = IncrementalDetokenizer(TOKENIZER, [])
    pieces = [ids(text)[i : i + 7] for i in range(0, len(ids(text)), 7)]
    assert "".join(chunked.append(piece) for piece in pieces) + chunked.flush() == text


def test_invalid_and_unfinished_bytes() -> None:
    detokenizer = IncrementalDetokenizer(TOKENIZER, [])
    assert detokenizer.append([0xFF]) == ""  # could still be the start of a character
    assert detokenizer.append([ord("a")]) == "\ufffda"  # followed by text: final
    assert detokenizer.append([0xC3]) == ""
    assert detokenizer.flush() == "\ufffd"  # nothing follows: the unfinished one is final
    assert detokenizer.flush() == ""  # once


def test_special_tokens_are_skipped_unless_asked_for() -> None:
    completion = [*ids("ok"), 256]
    assert decode_completion(TOKENIZER, ids("p"), completion) == "ok"
    assert decode_completion(TOKENIZER, ids("p"), completion, skip_special_tokens=False) == (
        "ok<eos>"
    )


def test_completion_text_stops_reading_after_a_match() -> None:
    text = CompletionText(TOKENIZER, ids("p"), ["lo"])
    assert not text.append(ids("hel"))
    assert text.append(ids("lo wor"))
    assert text.append(ids("ld"))  # stays stopped; the text does not grow
    assert text.flush()
    assert (text.text, text.matched, text.stopped) == ("hel", "lo", True)


def test_completion_text_within_min_tokens_and_at_the_end() -> None:
    text = CompletionText(TOKENIZER, ids("p"), ["ab"])
    assert not text.append(ids("ab"), check=False)  # still within min_tokens
    assert not text.append(ids("xa"))
    assert text.text == "abxa"
    assert text.append(ids("b"))
    assert (text.text, text.matched) == ("abx", "ab")
    ending = CompletionText(TOKENIZER, ids("p"), ["\ufffd"])
    assert not ending.append([ord("x"), 0xE2, 0x9C])  # an unfinished "✓"
    assert ending.flush()  # the request ended: the held-back U+FFFD is final text
    assert (ending.text, ending.matched) == ("x", "\ufffd")


# ------------------------------------------------- more rules, pinned by mutation testing
def test_the_first_occurrence_of_a_stop_in_a_delta_wins() -> None:
    matcher = StopStringMatcher(["a"])
    assert matcher.feed("xayaz")
    assert (matcher.text, matcher.matched) == ("x", "a")


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_at_the_very_start_of_the_text_matches(include: bool) -> None:
    matcher = StopStringMatcher(["ab"], include_stop_str=include)
    assert matcher.feed("abc")
    assert (matcher.text, matcher.matched) == ("ab" if include else "", "ab")


def test_one_append_returns_the_text_before_an_unfinished_character() -> None:
    detokenizer = IncrementalDetokenizer(TOKENIZER, [])
    assert detokenizer.append([*ids("ab"), 0xE2]) == "ab"  # "✓" is E2 9C 93
    assert detokenizer.append([0x9C, 0x93, ord("c")]) == "✓c"


def test_appends_that_each_end_in_an_unfinished_character_return_each_byte_once() -> None:
    detokenizer = IncrementalDetokenizer(TOKENIZER, [])
    # E2 then b: an invalid byte (final), so each append returns all but the last E2.
    deltas = [detokenizer.append(chunk) for chunk in ([ord("a"), 0xE2], [ord("b"), 0xE2], [99])]
    assert deltas == ["a", "\ufffdb", "\ufffdc"]
    assert detokenizer.flush() == ""


def test_flush_returns_the_held_back_character_once() -> None:
    detokenizer = IncrementalDetokenizer(TOKENIZER, [])
    assert detokenizer.append([ord("a"), 0xE2]) == "a"
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.flush() == ""


def test_special_tokens_are_skipped_by_default_on_every_path() -> None:
    completion = [*ids("ok"), 256, *ids("!")]
    assert IncrementalDetokenizer(TOKENIZER, []).append(completion) == "ok!"
    shown = IncrementalDetokenizer(TOKENIZER, [], skip_special_tokens=False)
    assert shown.append(completion) == "ok<eos>!"
    text = CompletionText(TOKENIZER, ids("p"), [])
    assert not text.append(completion)
    assert text.text == "ok!"
    text = CompletionText(TOKENIZER, ids("p"), [], skip_special_tokens=False)
    assert not text.append(completion)
    assert text.text == "ok<eos>!"


def test_completion_text_keeps_the_stop_string_when_asked() -> None:
    text = CompletionText(TOKENIZER, ids("p"), ["lo"], include_stop_str=True)
    assert text.stopped is False
    assert text.append(ids("hello world"))
    assert (text.text, text.matched, text.stopped) == ("hello", "lo", True)


class PieceTokenizer:
    """SentencePiece-like: ``"▁w"`` is a word after a space, and a string's first piece loses
    its space (``decode([HELLO]) == "Hello"``, but ``" Hello"`` after other text). Records the
    length of every decoded id list."""

    PIECES = ("▁Hi", "▁Hello", "▁world", "!", "▁again")

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(token_ids))
        text = "".join(self.PIECES[token] for token in token_ids).replace("▁", " ")
        return text.removeprefix(" ")


HI, HELLO, WORLD, BANG, AGAIN = range(5)


def test_a_first_word_keeps_its_space_after_a_short_prompt() -> None:
    assert PieceTokenizer().decode([HELLO]) == "Hello"
    detokenizer = IncrementalDetokenizer(PieceTokenizer(), [HI, BANG])
    assert detokenizer.append([HELLO]) == " Hello"
    assert decode_completion(PieceTokenizer(), [HI, BANG, HI], [HELLO, WORLD]) == " Hello world"


def test_each_append_decodes_a_short_window_however_long_the_stream() -> None:
    tokenizer = PieceTokenizer()
    words = [HELLO, WORLD, AGAIN] * 70  # the window's token list is trimmed past 64 tokens
    detokenizer = IncrementalDetokenizer(tokenizer, [HI] * 12)
    streamed = "".join(detokenizer.append([token]) for token in words) + detokenizer.flush()
    assert streamed == " " + PieceTokenizer().decode(words)
    assert max(tokenizer.lengths) <= 6  # the 5 prompt tokens of context and the new one
