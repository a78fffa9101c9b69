"""How the server tokenizes prompts (vLLM's ``add_special_tokens`` and
``truncate_prompt_tokens``), with a stand-in engine whose tokenizer adds a BOS token; and
``--ignore-unknown-fields`` in an app."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from pagedinfer.engine.prompts import TokenizedPrompt
from pagedinfer.serving.prompts import (
    ChatRendering,
    Truncation,
    encode_chat,
    encode_prompt,
    render_chat_ids,
)

BOS = 1


class Tokenizer:
    """One id per character (its code point), BOS first when special tokens are added."""

    chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [ord(char) for char in text]

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def _engine(**overrides: Any) -> Any:
    """What the functions read: ``tokenizer``, ``tokenize`` (here: the prompt as given,
    text prompts encoded the engine's way), ``config.model_path``."""
    tokenizer = Tokenizer()

    def tokenize(prompt: Any) -> TokenizedPrompt:
        if isinstance(prompt, TokenizedPrompt):
            return prompt
        if isinstance(prompt, str):
            return TokenizedPrompt(prompt, tuple(tokenizer.encode(prompt)))
        return TokenizedPrompt(None, tuple(prompt))

    fields = {
        "tokenizer": tokenizer,
        "tokenize": tokenize,
        "config": SimpleNamespace(model_path="/m"),
    }
    return SimpleNamespace(**{**fields, **overrides})


def test_add_special_tokens_reaches_the_tokenizer() -> None:
    engine = _engine()
    assert encode_prompt(engine, "ab").token_ids == (BOS, 97, 98)  # the engine's own path
    plain = encode_prompt(engine, "ab", add_special_tokens=False)
    assert plain == TokenizedPrompt("ab", (97, 98))  # text kept
    assert encode_prompt(engine, [5, 6], add_special_tokens=False).token_ids == (5, 6)
    messages = [{"role": "user", "content": "x"}]
    chat = encode_chat(engine, messages, ChatRendering())
    assert chat.text == "<user>x" and chat.token_ids[0] != BOS  # the template has the specials
    with_bos = encode_chat(engine, messages, ChatRendering(add_special_tokens=True))
    assert with_bos.token_ids == (BOS, *chat.token_ids)
    assert render_chat_ids(engine, messages, ChatRendering()) == list(chat.token_ids)


@pytest.mark.parametrize(
    ("truncation", "kept"),
    [
        (Truncation(), (BOS, 97, 98, 99, 100)),
        (Truncation(3), (98, 99, 100)),  # the last tokens (vLLM's default side)
        (Truncation(3, "left"), (98, 99, 100)),
        (Truncation(3, "right"), (BOS, 97, 98)),
        (Truncation(5), (BOS, 97, 98, 99, 100)),  # fits: nothing cut, text kept
    ],
)
def test_truncation_cuts_before_validation(truncation: Truncation, kept: tuple[int, ...]) -> None:
    prompt = encode_prompt(_engine(), "abcd", truncation=truncation)
    assert prompt.token_ids == kept
    cut = len(kept) < 5
    assert prompt.text == (None if cut else "abcd")  # a cut prompt's text is decoded later
    ids = encode_prompt(_engine(), [1, 2, 3, 4, 5], truncation=truncation)
    assert len(ids.token_ids) == len(kept) and ids.text is None


def test_unknown_fields_can_be_ignored_as_vllm_does(
    make_checkpoint: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    from pagedinfer import AsyncEngine
    from pagedinfer.serving import ServingOptions, build_app

    checkpoint = make_checkpoint("tiny", with_tokenizer=True)
    engine = AsyncEngine(checkpoint, device="cpu", num_kv_blocks=16, max_model_len=64)
    body = {"prompt": "hi", "max_tokens": 2, "frobnicate": 1}

    async def post(options: ServingOptions) -> httpx.Response:
        app = build_app(engine, served_model_name="m", options=options)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            return await c.post("/v1/completions", json=body)

    try:
        refused = asyncio.run(post(ServingOptions()))
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "frobnicate"
        with caplog.at_level(logging.WARNING, logger="pagedinfer.serving"):
            served = asyncio.run(post(ServingOptions(ignore_unknown_fields=True)))
        assert served.status_code == 200, served.text
        assert any("frobnicate" in record.getMessage() for record in caplog.records)
    finally:
        engine.close()
