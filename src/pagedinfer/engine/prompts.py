"""The prompt forms :meth:`pagedinfer.Engine.generate` accepts, and their tokenization.

A prompt is a string, a list of token ids, ``{"prompt": str}`` or ``{"prompt_token_ids":
[...]}`` (vLLM's forms), or a :class:`TokenizedPrompt` that :meth:`pagedinfer.Engine.tokenize`
made; ``generate`` takes one prompt or a list of them. :func:`parse_prompts` turns any of
these into :class:`PromptInput` values (text or token ids) without tokenizing, so a batch is
checked completely before anything is queued.

:class:`PromptEncoder` tokenizes and validates a prompt (not empty, every id in the
vocabulary, short enough for ``max_model_len``; the length first, so an overlong id list is
refused before its ids are looked at). It holds no mutable state and takes no engine lock:
the engine runs it in the caller's thread before locking, so a long prompt never stalls the
other threads (the tokenizer's thread safety: docs/api.md, "Threads").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from pagedinfer.errors import InvalidRequestError

__all__ = [
    "Prompt",
    "PromptEncoder",
    "PromptInput",
    "TokenizedPrompt",
    "parse_prompt",
    "parse_prompts",
]


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    """A prompt already tokenized and validated: what :meth:`pagedinfer.Engine.tokenize`
    returns, accepted wherever a prompt is (``generate``, ``add_request``, ``stream``,
    ``AsyncEngine.generate``) without tokenizing again.

    ``text`` is the prompt's text (``None`` for a token-id prompt; the rendered template for
    a chat), ``token_ids`` its tokens: not empty, every id in the model's vocabulary, and
    short enough that the first generated token fits ``max_model_len``. One built by hand is
    accepted too; the engine then checks its ids (without tokenizing).
    """

    text: str | None
    token_ids: tuple[int, ...]
    # The encoder that validated it: an engine trusts only its own (its vocabulary and
    # max_model_len); others are checked again.
    _checked_by: object = field(default=None, init=False, repr=False, compare=False)


# What a caller may pass as one prompt (dicts as vLLM's TextPrompt / TokensPrompt).
Prompt: TypeAlias = str | Sequence[int] | Mapping[str, Any] | TokenizedPrompt

_FORMS = 'a string, a list of token ids, {"prompt": str} or {"prompt_token_ids": [int, ...]}'


@dataclass(frozen=True, slots=True)
class PromptInput:
    """One parsed prompt: its text (``None`` for token-id prompts) or its token ids."""

    text: str | None
    token_ids: list[int] | None


def parse_prompt(prompt: object) -> PromptInput | TokenizedPrompt:
    """Check the form of one prompt (not its tokens: the engine checks those)."""
    if isinstance(prompt, TokenizedPrompt):
        return prompt
    if isinstance(prompt, str):
        return PromptInput(text=prompt, token_ids=None)
    if isinstance(prompt, Mapping):
        return _parse_dict(prompt)
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        return PromptInput(text=None, token_ids=list(prompt))
    raise InvalidRequestError(f"a prompt must be {_FORMS}, not {type(prompt).__name__}.")


def parse_prompts(prompts: object) -> list[PromptInput | TokenizedPrompt]:
    """One prompt or a list of prompts -> the list of parsed prompts, in order.

    A flat list of integers is one token-id prompt; a list of anything else is a batch.
    """
    if isinstance(prompts, (str, Mapping, TokenizedPrompt)):
        return [parse_prompt(prompts)]
    if isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        items = list(prompts)
        if items and all(_is_int(item) for item in items):
            return [PromptInput(text=None, token_ids=items)]
        return [parse_prompt(item) for item in items]
    raise InvalidRequestError(
        f"prompts must be one prompt or a list of prompts ({_FORMS}), not {type(prompts).__name__}."
    )


def _parse_dict(prompt: Mapping[Any, Any]) -> PromptInput:
    keys = set(prompt)
    if keys == {"prompt"}:
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise InvalidRequestError(
                f'{{"prompt": ...}} must hold a string, not {type(text).__name__}.'
            )
        return PromptInput(text=text, token_ids=None)
    if keys == {"prompt_token_ids"}:
        token_ids = prompt["prompt_token_ids"]
        if isinstance(token_ids, (str, bytes, Mapping)) or not isinstance(token_ids, Sequence):
            raise InvalidRequestError(
                '{"prompt_token_ids": ...} must hold a list of token ids, '
                f"not {type(token_ids).__name__}."
            )
        return PromptInput(text=None, token_ids=list(token_ids))
    raise InvalidRequestError(
        f"a dict prompt must have exactly one key, 'prompt' or 'prompt_token_ids'; "
        f"got {sorted(map(str, keys))}."
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class PromptEncoder:
    """Tokenizes and validates prompts for one engine; stateless, safe from any thread."""

    __slots__ = ("_model_path", "_tokenizer", "max_model_len", "vocab_size")

    def __init__(
        self, tokenizer: Any, *, vocab_size: int, max_model_len: int, model_path: str
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._model_path = model_path

    def encode(self, prompt: object) -> TokenizedPrompt:
        """Any prompt form (parsed or not) -> a validated :class:`TokenizedPrompt`."""
        parsed = prompt if isinstance(prompt, PromptInput) else parse_prompt(prompt)
        if isinstance(parsed, TokenizedPrompt):
            if parsed._checked_by is self:
                return parsed
            return self.from_ids(parsed.token_ids, parsed.text)
        if parsed.token_ids is not None:
            return self.from_ids(parsed.token_ids, parsed.text)
        text = parsed.text
        assert text is not None
        if self._tokenizer is None:
            raise InvalidRequestError(
                f"the checkpoint {self._model_path} has no tokenizer files, so text prompts "
                "cannot be encoded: pass token-id lists instead."
            )
        if not text:
            raise InvalidRequestError("the prompt is empty: a request needs at least one token.")
        return self.from_ids(self._tokenizer.encode(text), text)

    def from_ids(self, token_ids: Sequence[int], text: str | None) -> TokenizedPrompt:
        """Validate token ids: the length first (O(1)), then each id."""
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise InvalidRequestError(
                f"token ids must be a list of integers, not {type(token_ids).__name__}."
            )
        count = len(token_ids)
        if not count:
            raise InvalidRequestError("the prompt is empty: a request needs at least one token.")
        limit = self.max_model_len
        if count + 1 > limit:
            raise InvalidRequestError(
                f"the prompt has {count} tokens; with the first generated token that exceeds "
                f"max_model_len={limit}. Shorten the prompt to at most {limit - 1} tokens or "
                "raise max_model_len."
            )
        vocab_size = self.vocab_size
        for token_id in token_ids:
            if not _is_int(token_id):
                raise InvalidRequestError(f"token id {token_id!r} is not an integer.")
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"token id {token_id} is out of vocabulary: ids must be in [0, {vocab_size})."
                )
        checked = TokenizedPrompt(text, tuple(token_ids))
        object.__setattr__(checked, "_checked_by", self)
        return checked
