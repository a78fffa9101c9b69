"""Incremental detokenization for streaming and stop strings.

Decoding the whole completion after every token costs O(n) per step; instead we keep two
offsets into the token list (the approach of Hugging Face's text-generation-inference and
vLLM): decode a short window that starts a few tokens back, and emit only the text that the
newest tokens added. A window whose text ends in U+FFFD is an unfinished multi-byte
character, so nothing is emitted until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "StopStringMatcher"]

# Tokens of the prompt kept as left context: some tokenizers (SentencePiece) decode a token
# differently at the start of a string than after other text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def append(self, token_ids: list[int]) -> str:
        """Add generated tokens; return the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep the token list short: only the window from prefix_offset is ever decoded.
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return full_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        text: str = self._tokenizer.decode(token_ids, skip_special_tokens=True)
        return text


class StopStringMatcher:
    """Accumulates streamed text and finds the first stop string in it."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = stop
        self._longest = max((len(s) for s in stop), default=0)
        self.text = ""

    def feed(self, delta: str) -> bool:
        """Append ``delta``; if a stop string now occurs, cut the text before it, return True."""
        start = max(len(self.text) - self._longest + 1, 0)
        self.text += delta
        found = -1
        for stop in self._stop:
            index = self.text.find(stop, start)
            if index != -1 and (found == -1 or index < found):
                found = index
        if found == -1:
            return False
        self.text = self.text[:found]
        return True
