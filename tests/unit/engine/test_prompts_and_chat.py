"""Prompt forms (vLLM's dict prompts) and chat rendering, without an engine."""

from __future__ import annotations

from typing import Any

import pytest

from pagedinfer.adapters.models.random_checkpoint import build_tokenizer
from pagedinfer.engine.chat import render_chat
from pagedinfer.engine.prompts import PromptInput, parse_prompts
from pagedinfer.errors import InvalidRequestError

# A small Qwen3-like template: enable_thinking arrives through chat_template_kwargs.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer(512)


def test_every_prompt_form() -> None:
    text, ids = PromptInput("hi", None), PromptInput(None, [1, 2])
    assert parse_prompts("hi") == [text]
    assert parse_prompts([1, 2]) == [ids]
    assert parse_prompts((1, 2)) == [ids]
    assert parse_prompts({"prompt": "hi"}) == [text]
    assert parse_prompts({"prompt_token_ids": [1, 2]}) == [ids]
    assert parse_prompts(["hi", [1, 2], {"prompt": "hi"}, {"prompt_token_ids": (1, 2)}]) == [
        text,
        ids,
        text,
        ids,
    ]
    assert parse_prompts([]) == []


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        (3, "not int"),
        (None, "not NoneType"),
        (b"bytes", "not bytes"),
        ([3.5], "not float"),
        ({"text": "hi"}, "exactly one key"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one key"),
        ({"prompt": [1, 2]}, "must hold a string"),
        ({"prompt_token_ids": "12"}, "list of token ids"),
        ([{"prompt_token_ids": 5}], "list of token ids"),
    ],
)
def test_bad_prompt_forms_say_what_is_allowed(prompts: object, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        parse_prompts(prompts)


def test_chat_renders_the_template_and_tokenizes_like_apply_chat_template(tokenizer: Any) -> None:
    (prompt,) = render_chat(tokenizer, CHAT, chat_template=TEMPLATE)
    assert prompt.text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    expected = tokenizer.apply_chat_template(
        CHAT, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert prompt.token_ids == list(expected)


def test_chat_template_kwargs_reach_the_template(tokenizer: Any) -> None:
    (thinking,) = render_chat(tokenizer, CHAT, chat_template=TEMPLATE)
    (direct,) = render_chat(
        tokenizer, CHAT, chat_template=TEMPLATE, chat_template_kwargs={"enable_thinking": False}
    )
    assert direct.text == f"{thinking.text}<think>\n\n</think>\n\n"
    (bare,) = render_chat(tokenizer, CHAT, chat_template=TEMPLATE, add_generation_prompt=False)
    assert bare.text == "<|im_start|>user\nHello there<|im_end|>\n"


def test_a_list_of_conversations(tokenizer: Any) -> None:
    other = [{"role": "system", "content": "Be brief."}, *CHAT]
    prompts = render_chat(tokenizer, [CHAT, other], chat_template=TEMPLATE)
    assert len(prompts) == 2 and prompts[1].text is not None
    assert prompts[1].text.startswith("<|im_start|>system\nBe brief.")


def test_the_tokenizer_template_is_the_default(tokenizer: Any) -> None:
    tokenizer.chat_template = TEMPLATE
    try:
        assert render_chat(tokenizer, CHAT) == render_chat(tokenizer, CHAT, chat_template=TEMPLATE)
    finally:
        tokenizer.chat_template = None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"messages": CHAT}, "no chat template"),
        ({"messages": "hello", "chat_template": TEMPLATE}, "list of"),
        ({"messages": [], "chat_template": TEMPLATE}, "at least one message"),
        ({"messages": [["user", "hi"]], "chat_template": TEMPLATE}, "'role'"),
        ({"messages": CHAT, "chat_template": 5}, "Jinja template string"),
        ({"messages": CHAT, "chat_template": "{{ raise_exception('no system') }}"}, "no system"),
        (
            {"messages": CHAT, "chat_template": TEMPLATE, "chat_template_kwargs": {"tokenize": 1}},
            "may not set",
        ),
        ({"messages": CHAT, "chat_template": TEMPLATE, "chat_template_kwargs": [1]}, "dict"),
        ({"messages": CHAT, "chat_template": TEMPLATE, "add_generation_prompt": 1}, "True or"),
    ],
)
def test_bad_chat_input_is_a_clear_error(
    tokenizer: Any, kwargs: dict[str, Any], match: str
) -> None:
    kwargs = dict(kwargs)
    messages = kwargs.pop("messages")
    with pytest.raises(InvalidRequestError, match=match):
        render_chat(tokenizer, messages, **kwargs)


def test_chat_without_a_tokenizer() -> None:
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        render_chat(None, CHAT, chat_template=TEMPLATE, model_path="/ckpt")
