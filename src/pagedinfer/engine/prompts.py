"""The prompt forms :meth:`pagedinfer.Engine.generate` accepts, as vLLM spells them.

A prompt is a string, a list of token ids, ``{"prompt": str}`` or ``{"prompt_token_ids":
[...]}``; ``generate`` takes one prompt or a list of them. :func:`parse_prompts` turns any of
these into :class:`PromptInput` values (text or token ids) without tokenizing, so a batch is
checked completely before anything is queued.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from pagedinfer.errors import InvalidRequestError

__all__ = ["Prompt", "PromptInput", "parse_prompt", "parse_prompts"]

# What a caller may pass as one prompt (dicts as vLLM's TextPrompt / TokensPrompt).
Prompt: TypeAlias = str | Sequence[int] | Mapping[str, Any]

_FORMS = 'a string, a list of token ids, {"prompt": str} or {"prompt_token_ids": [int, ...]}'


@dataclass(frozen=True, slots=True)
class PromptInput:
    """One parsed prompt: its text (``None`` for token-id prompts) or its token ids."""

    text: str | None
    token_ids: list[int] | None


def parse_prompt(prompt: object) -> PromptInput:
    """Check the form of one prompt (not its tokens: the engine checks those)."""
    if isinstance(prompt, str):
        return PromptInput(text=prompt, token_ids=None)
    if isinstance(prompt, Mapping):
        return _parse_dict(prompt)
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        return PromptInput(text=None, token_ids=list(prompt))
    raise InvalidRequestError(f"a prompt must be {_FORMS}, not {type(prompt).__name__}.")


def parse_prompts(prompts: object) -> list[PromptInput]:
    """One prompt or a list of prompts -> the list of parsed prompts, in order.

    A flat list of integers is one token-id prompt; a list of anything else is a batch.
    """
    if isinstance(prompts, (str, Mapping)):
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
