"""A chat request checked, rendered and queued (:func:`submit_chat`): what
``/v1/chat/completions`` does, and what the APIs that are a chat in another shape (OpenAI's
Responses API, Anthropic's Messages API) do with the chat request they are translated into;
their answer is read back with its tool calls and (with a reasoning parser) its reasoning
split off (:class:`Reasoner`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.engine.async_engine import AsyncRequestStream
from pagedinfer.engine.prompts import TokenizedPrompt
from pagedinfer.serving.prompts import Truncation, encode_chat
from pagedinfer.serving.protocol import (
    ChatCompletionRequest,
    chat_messages,
    chat_sampling_params,
    check_sizes,
    truncation_limit,
)
from pagedinfer.serving.reasoning.plan import ReasoningPlan, plan_reasoning
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
    """A queued chat: its output stream, its prompt, its checked sampling parameters, how its
    tool calls are read (``None``: the answer is text), its reasoning plan, how its reasoning
    is split off (``None``: it is not: no ``--reasoning-parser``, or thinking is off) and how
    many of its tokens are reasoning."""

    stream: AsyncRequestStream
    prompt: TokenizedPrompt
    params: SamplingParams
    tools: ToolCalls | None
    reasoning: ReasoningPlan
    reasoner: Reasoner | None
    reasoning_tokens: Callable[[Sequence[int]], int]  # of an answer's token ids


async def submit_chat(chat: ChatCompletionRequest, state: ServingState) -> SubmittedChat:
    """Check ``chat`` cheapest first (its fields, sizes, tools, constraint and sampling
    parameters: a 4xx for what cannot be served), render and tokenize its template in a
    worker thread and queue it. With a reasoning parser, its constraint starts after the
    reasoning."""
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
    truncation = Truncation(truncation_limit(chat, engine.max_model_len), chat.truncation_side)
    rendering = state.rendering(chat)
    prompt = await asyncio.to_thread(
        encode_chat, engine.engine, chat_messages(chat), rendering, truncation
    )
    reasoning = plan_reasoning(
        state.reasoning,
        state.reasoning_end,
        include_reasoning=chat.include_reasoning,
        prompt_text=prompt.text
        if prompt.text is not None
        else state.decode(prompt.token_ids[-32:]),
        template_kwargs=rendering.template_kwargs,
        continued=chat.continue_final_message,
    )
    if structured is not None:
        params = reasoning.gated(params, structured.field)
    stream = state.submit(prompt, params, structured, chat.model)
    end_texts = tools.calls.end_texts if tools.calls is not None else ()
    return SubmittedChat(
        stream,
        prompt,
        params,
        tools.calls,
        reasoning,
        _reasoner(reasoning, end_texts),
        _reasoning_tokens(reasoning),
    )


def _reasoner(plan: ReasoningPlan, end_texts: tuple[str, ...]) -> Reasoner | None:
    """The plan's parser as the routes use it (``None``: no parser, or an answer that does
    not start in reasoning)."""
    parser = plan.parser
    if parser is None or not plan.thinking:
        return None

    def split(text: str, final: bool) -> ReasoningSplit:
        parts = parser.split(text, thinking=True, final=final, end_texts=end_texts)
        return ReasoningSplit(parts.reasoning or "", parts.content)

    return split


def _reasoning_tokens(plan: ReasoningPlan) -> Callable[[Sequence[int]], int]:
    """How many of an answer's tokens are reasoning: up to and including the end marker's
    token (all of them when it never came), none when the answer does not reason."""
    end_ids = frozenset(plan.end.token_ids) if plan.end is not None else frozenset()

    def count(token_ids: Sequence[int]) -> int:
        if plan.parser is None or not plan.thinking:
            return 0
        for index, token_id in enumerate(token_ids):
            if token_id in end_ids:
                return index + 1
        return len(token_ids)

    return count
