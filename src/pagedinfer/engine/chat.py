"""Chat conversations to prompts through the tokenizer's chat template (``Engine.chat``).

A conversation is a list of messages (``{"role": ..., "content": ...}``); ``Engine.chat``
takes one conversation or a list of them. Each is rendered with the tokenizer's Jinja chat
template (or the ``chat_template`` given), then tokenized without adding special tokens, as
transformers' ``apply_chat_template(tokenize=True)`` does: the template already holds them.
``chat_template_kwargs`` reach the template as variables (Qwen3's ``enable_thinking``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedinfer.engine.prompts import PromptInput
from pagedinfer.errors import InvalidRequestError

__all__ = ["render_chat"]

# Arguments of apply_chat_template that render_chat sets itself: a template variable of the
# same name cannot be passed through chat_template_kwargs.
_RESERVED = frozenset(
    {
        "conversation",
        "chat_template",
        "add_generation_prompt",
        "tokenize",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
    }
)


def render_chat(
    tokenizer: Any,
    messages: object,
    *,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    model_path: str = "the checkpoint",
) -> list[PromptInput]:
    """One :class:`PromptInput` (rendered text and its token ids) per conversation."""
    if tokenizer is None:
        raise InvalidRequestError(
            f"{model_path} has no tokenizer files, so chat messages cannot be rendered: "
            "pass token ids to generate() instead."
        )
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            f"the tokenizer of {model_path} has no chat template: pass one as "
            "chat(..., chat_template=JINJA_TEMPLATE) or use generate() with a plain prompt."
        )
    if chat_template is not None and not isinstance(chat_template, str):
        raise InvalidRequestError(
            f"chat_template must be a Jinja template string, not {type(chat_template).__name__}."
        )
    if not isinstance(add_generation_prompt, bool):
        raise InvalidRequestError(
            f"add_generation_prompt must be True or False, not {add_generation_prompt!r}."
        )
    kwargs = _template_kwargs(chat_template_kwargs)
    prompts = []
    for conversation in _conversations(messages):
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
        except Exception as error:  # jinja2 errors, raise_exception() in the template
            raise InvalidRequestError(
                f"the chat template could not render the messages: {error}"
            ) from error
        token_ids = list(tokenizer.encode(text, add_special_tokens=False))
        prompts.append(PromptInput(text=text, token_ids=token_ids))
    return prompts


def _conversations(messages: object) -> list[list[Mapping[str, Any]]]:
    """``messages`` is one conversation (a list of dicts) or a list of conversations."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise InvalidRequestError(
            "messages must be a list of {'role': ..., 'content': ...} dicts, or a list of "
            f"such lists; got {type(messages).__name__}."
        )
    items = list(messages)
    if items and all(isinstance(item, Sequence) and not isinstance(item, str) for item in items):
        conversations = [list(item) for item in items]
    else:
        conversations = [items]
    for conversation in conversations:
        if not conversation:
            raise InvalidRequestError("a conversation needs at least one message.")
        for message in conversation:
            if not isinstance(message, Mapping) or "role" not in message:
                raise InvalidRequestError(
                    "each message must be a dict with a 'role' (and usually a 'content'); "
                    f"got {message!r}."
                )
    return conversations


def _template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise InvalidRequestError(
            f"chat_template_kwargs must be a dict of template variables, not {kwargs!r}."
        )
    clash = sorted(_RESERVED.intersection(kwargs))
    if clash:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {clash}: chat() sets these itself (pass "
            "chat_template and add_generation_prompt as chat()'s own arguments)."
        )
    return dict(kwargs)
