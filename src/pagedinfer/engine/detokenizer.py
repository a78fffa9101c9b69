"""Incremental detokenization for streaming and stop strings.

Decoding the whole completion after every token costs O(n) per step; instead we keep two
offsets into the token list (the approach of Hugging Face's text-generation-inference and
vLLM): decode a short window that starts a few tokens back, and emit only the text that the
newest tokens added. A window whose text ends in U+FFFD ends in an unfinished multi-byte
character: the text before it is emitted, the character once a later token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["CompletionText", "IncrementalDetokenizer", "StopStringMatcher", "decode_completion"]

# Tokens of the prompt kept as left context: some tokenizers (SentencePiece) decode a token
# differently at the start of a string than after other text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, returning only what each append adds.

    Text is returned as soon as it is final: a token that completes some characters and
    starts another (a multi-byte character split across tokens) returns the complete
    characters at once and holds back only the unfinished one, which decodes to one U+FFFD
    until the token that completes it arrives (a U+FFFD that is not last is an invalid
    byte, and final). :meth:`flush` returns what is still held back when no token follows.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], *, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Characters of the window past read_offset already returned (the final part of a
        # text that still ends in an unfinished character).
        self._emitted = 0

    def append(self, token_ids: list[int]) -> str:
        """Add generated tokens; return the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        start = len(prefix_text) + self._emitted
        # An unfinished UTF-8 sequence decodes to one U+FFFD (its maximal subpart), so only
        # a U+FFFD at the very end can still change; earlier ones are invalid bytes, final.
        final_text = full_text[:-1] if full_text.endswith("\ufffd") else full_text
        if len(final_text) < len(full_text) or len(full_text) <= len(prefix_text):
            # An unfinished character at the end (or nothing new yet): return what precedes
            # it and keep the window open until the character is complete.
            new_text = final_text[start:]
            self._emitted += len(new_text)
            return new_text
        new_text = full_text[start:]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._emitted = 0
        # Keep the token list short: only the window from prefix_offset is ever decoded.
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text

    def flush(self) -> str:
        """The text still held back (an unfinished character at the very end, as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        new_text = full_text[len(prefix_text) + self._emitted :]
        self._emitted += len(new_text)
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        text: str = self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return text


def decode_completion(
    tokenizer: Any,
    prompt_token_ids: list[int],
    completion_token_ids: list[int],
    *,
    skip_special_tokens: bool = True,
) -> str:
    """A whole completion's text as :class:`IncrementalDetokenizer` streams it: decoded after
    the prompt's last tokens, not on its own.

    The two differ where a tokenizer decodes a token differently at the start of a string:
    SentencePiece drops the leading space of a first word (``"▁Hello"`` is ``"Hello"`` alone
    but ``" Hello"`` after other text). A completion continues its prompt, so it keeps the
    space (as vLLM's outputs do), and its final text equals its streamed text.
    """
    detokenizer = IncrementalDetokenizer(
        tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens
    )
    return detokenizer.append(list(completion_token_ids)) + detokenizer.flush()


class StopStringMatcher:
    """Accumulates streamed text and finds the first stop string in it.

    The text ends before the matched string, or after it with ``include_stop_str``;
    ``matched`` is the string. Text fed with ``check=False`` (before ``min_tokens`` were
    generated) is only searched as the start of a match that ends in later text.
    """

    def __init__(self, stop: Sequence[str], *, include_stop_str: bool = False) -> None:
        self._stop = stop
        self._include = include_stop_str
        self.text = ""
        self.matched: str | None = None

    def feed(self, delta: str, *, check: bool = True) -> bool:
        """Append ``delta``; if a stop string now occurs, cut the text there, return True.

        A match must end in ``delta``: one that ended earlier either stopped the text then
        or lies in text fed with ``check=False``, where no match may end (a short stop
        string inside the ``min_tokens`` text matched before issue 21's fuzzing found it).
        """
        before = len(self.text)
        self.text += delta
        if not check:
            return False
        found = -1
        matched = ""
        for stop in self._stop:
            index = self.text.find(stop, max(before - len(stop) + 1, 0))
            if index != -1 and (found == -1 or index < found):
                found, matched = index, stop
        if found == -1:
            return False
        self.matched = matched
        self.text = self.text[: found + len(matched) if self._include else found]
        return True


class CompletionText:
    """A completion's text, grown token by token, cut at the first stop string.

    A stop string matches as soon as the text that completes it is final, even when that
    text spans several tokens or shares a token with the start of an unfinished character.
    """

    __slots__ = ("_detokenizer", "_matcher", "stopped")

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: Sequence[str],
        *,
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
        self._matcher = StopStringMatcher(stop, include_stop_str=include_stop_str)
        self.stopped = False

    @property
    def text(self) -> str:
        """The text so far (final), ending before a matched stop string."""
        return self._matcher.text

    @property
    def matched(self) -> str | None:
        """The stop string that matched, if one did."""
        return self._matcher.matched

    def append(self, token_ids: list[int], *, check: bool = True) -> bool:
        """Add generated tokens; True once a stop string has matched. ``check=False``: the
        tokens are still within ``min_tokens``, so no stop string may end in them."""
        if not self.stopped:
            self.stopped = self._matcher.feed(self._detokenizer.append(token_ids), check=check)
        return self.stopped

    def flush(self) -> bool:
        """No token follows: take the held-back text too; True once a stop string matched."""
        if not self.stopped:
            self.stopped = self._matcher.feed(self._detokenizer.flush())
        return self.stopped
