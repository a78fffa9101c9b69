"""Serving an API that is a chat in another shape (OpenAI's Responses API, Anthropic's
Messages API): the chat request it was translated into is checked, rendered and queued as
``/v1/chat/completions`` does it (:func:`submit_chat`), and the answer is read back with its
tool calls and (with a reasoning parser) its reasoning split off (:class:`Reasoner`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedinfer.engine.async_engine import AsyncRequestStream
from pagedinfer.engine.prompts import TokenizedPrompt
from pagedinfer.serving.prompts import encode_chat
from pagedinfer.serving.protocol import (
    ChatCompletionRequest,
    chat_messages,
    chat_sampling_params,
    check_sizes,
)
from pagedinfer.serving.state import ServingState
from pagedinfer.serving.structured import structured_request
from pagedinfer.serving.tools import ToolCalls, plan_tools

__all__ = ["Reasoner", "ReasoningSplit", "SubmittedChat", "split_answer", "submit_chat"]


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """An answer's text so far, split at the end of its reasoning: the reasoning, the answer
    after it (empty until the reasoning ends)."""

    reasoning: str
    content: str


# A reasoning parser as these routes use it: (the whole text so far, finished) -> the
# split. Pure and cumulative: each part only grows as the text grows.
Reasoner = Callable[[str, bool], ReasoningSplit]


def split_answer(text: str, reasoner: Reasoner | None, finished: bool) -> ReasoningSplit:
    """``text`` split by the reasoning parser (none: it is all answer)."""
    if reasoner is None:
        return ReasoningSplit("", text)
    return reasoner(text, finished)


@dataclass(frozen=True, slots=True)
class SubmittedChat:
    """A queued chat: its output stream, its prompt, how its tool calls are read (``None``:
    the answer is text), how its reasoning is split off (``None``: it is not) and how many
    of its tokens are reasoning."""

    stream: AsyncRequestStream
    prompt: TokenizedPrompt
    tools: ToolCalls | None
    reasoner: Reasoner | None
    reasoning_tokens: Callable[[Sequence[int]], int]  # of an answer's token ids


async def submit_chat(chat: ChatCompletionRequest, state: ServingState) -> SubmittedChat:
    """Check ``chat`` (its fields, sizes, tools, constraint and sampling parameters: a 4xx
    for what cannot be served), render its template in a worker thread and queue it."""
    state.admit(chat)
    engine, options = state.engine, state.options
    check_sizes(chat, state.limits, state.vocab_size)
    tools = plan_tools(
        chat.tools,
        chat.tool_choice,
        chat.parallel_tool_calls,
        parser=options.tool_call_parser,
        auto_tool_choice=options.enable_auto_tool_choice,
        end_texts=state.end_texts,
    )
    structured = structured_request(chat, tools.constraint)
    params = chat_sampling_params(
        chat,
        None if structured is None else structured.params,
        keep_special_tokens=tools.keeps_special_tokens,
    )
    params = await state.checked(params, structured)
    prompt = await asyncio.to_thread(
        encode_chat, engine.engine, chat_messages(chat), state.rendering(chat)
    )
    stream = state.submit(prompt, params, structured)
    reasoner: Reasoner | None = None  # the server's reasoning parser: none yet
    return SubmittedChat(stream, prompt, tools.calls, reasoner, _no_reasoning)


def _no_reasoning(token_ids: Sequence[int]) -> int:
    return 0
