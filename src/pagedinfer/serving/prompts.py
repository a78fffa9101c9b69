"""Prompts as the server tokenizes them: vLLM's ``add_special_tokens`` and
``truncate_prompt_tokens``, chats rendered with the server's template, ``/tokenize`` and
``/detokenize``.

Every function here is blocking and takes no lock: the app runs them in worker threads
(``asyncio.to_thread``), never on the event loop. Prompts for generation end up in
:meth:`Engine.tokenize <pagedinfer.Engine.tokenize>`, which validates them (not empty, ids
in the vocabulary, short enough for ``max_model_len``); truncation happens before that
check, so a prompt too long for the context can be cut to fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedinfer.engine.chat import render_chat
from pagedinfer.engine.engine import Engine
from pagedinfer.engine.prompts import TokenizedPrompt
from pagedinfer.errors import InvalidRequestError

__all__ = [
    "ChatRendering",
    "Truncation",
    "decode_tokens",
    "encode_chat",
    "encode_prompt",
    "render_chat_ids",
    "token_strings",
    "tokenize_text",
]


@dataclass(frozen=True, slots=True)
class Truncation:
    """Keep ``keep`` prompt tokens (``None``: all): the last ones (``side="left"`` cuts the
    left, vLLM's default) or the first ones (``"right"``)."""

    keep: int | None = None
    side: str | None = None

    def apply(self, token_ids: list[int]) -> tuple[list[int], bool]:
        """The kept tokens, and whether any was cut."""
        keep = self.keep
        if keep is None or len(token_ids) <= keep:
            return token_ids, False
        if self.side == "right":
            return token_ids[:keep], True
        return token_ids[len(token_ids) - keep :], True


@dataclass(frozen=True, slots=True)
class ChatRendering:
    """How to render a conversation: the template (``None``: the tokenizer's), its
    variables, whether it ends with the assistant turn's opening, and whether the tokenizer
    adds its special tokens (BOS) on top of the template's."""

    chat_template: str | None = None
    template_kwargs: Mapping[str, Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


def encode_prompt(
    engine: Engine,
    prompt: str | list[int],
    *,
    add_special_tokens: bool = True,
    truncation: Truncation = Truncation(),  # frozen: a safe default
) -> TokenizedPrompt:
    """One completion prompt, tokenized (``add_special_tokens``: the tokenizer's BOS and
    the like; token ids are taken as they are), truncated and validated. A truncated text
    prompt becomes a token-id prompt (its text is decoded from the kept ids where needed)."""
    if truncation.keep is None and add_special_tokens:
        return engine.tokenize(prompt)  # the engine's own path, text kept
    text: str | None
    if isinstance(prompt, str):
        if engine.tokenizer is None or not prompt:
            return engine.tokenize(prompt)  # its error says what is missing
        token_ids = list(engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        text = prompt
    else:
        token_ids, text = list(prompt), None
    token_ids, cut = truncation.apply(token_ids)
    return engine.tokenize(TokenizedPrompt(None if cut else text, tuple(token_ids)))


def encode_chat(
    engine: Engine,
    messages: Sequence[Mapping[str, Any]],
    rendering: ChatRendering,
    truncation: Truncation = Truncation(),  # frozen: a safe default
) -> TokenizedPrompt:
    """One conversation rendered, tokenized, truncated and validated (``text`` is the
    rendered template, ``None`` once truncated)."""
    text, token_ids = _render(engine, messages, rendering)
    token_ids, cut = truncation.apply(token_ids)
    return engine.tokenize(TokenizedPrompt(None if cut else text, tuple(token_ids)))


def render_chat_ids(
    engine: Engine, messages: Sequence[Mapping[str, Any]], rendering: ChatRendering
) -> list[int]:
    """The token ids of a rendered conversation, unchecked against ``max_model_len``
    (``/tokenize``)."""
    return _render(engine, messages, rendering)[1]


def tokenize_text(engine: Engine, text: str, *, add_special_tokens: bool) -> list[int]:
    """A text's token ids, unchecked against ``max_model_len`` (``/tokenize``)."""
    return list(_tokenizer(engine).encode(text, add_special_tokens=add_special_tokens))


def token_strings(engine: Engine, token_ids: Sequence[int]) -> list[str]:
    """The tokenizer's string for each id (``/tokenize``'s ``return_token_strs``)."""
    strings = _tokenizer(engine).convert_ids_to_tokens(list(token_ids))
    return [str(item) for item in strings]


def decode_tokens(engine: Engine, token_ids: Sequence[int]) -> str:
    """The text of token ids (``/detokenize``); ids outside the vocabulary are a 400."""
    vocab_size = engine.model_config.vocab_size
    for token_id in token_ids:
        if token_id >= vocab_size:
            raise InvalidRequestError(
                f"token id {token_id} is out of vocabulary: ids must be in [0, {vocab_size})."
            )
    text: str = _tokenizer(engine).decode(list(token_ids))
    return text


def _render(
    engine: Engine, messages: Sequence[Mapping[str, Any]], rendering: ChatRendering
) -> tuple[str, list[int]]:
    (rendered,) = render_chat(
        engine.tokenizer,
        list(messages),
        chat_template=rendering.chat_template,
        chat_template_kwargs=rendering.template_kwargs,
        add_generation_prompt=rendering.add_generation_prompt,
        model_path=engine.config.model_path,
    )
    text = rendered.text
    assert text is not None and rendered.token_ids is not None
    token_ids = list(rendered.token_ids)
    if rendering.add_special_tokens:
        token_ids = list(engine.tokenizer.encode(text, add_special_tokens=True))
    return text, token_ids


def _tokenizer(engine: Engine) -> Any:
    if engine.tokenizer is None:
        raise InvalidRequestError(
            f"the checkpoint {engine.config.model_path} has no tokenizer files, so this "
            "server cannot tokenize or detokenize text."
        )
    return engine.tokenizer
