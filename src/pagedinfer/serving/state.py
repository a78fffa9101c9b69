"""What every route of the app reads: :class:`ServingState`, built once by ``build_app`` and
kept on ``app.state.serving``; a route takes it as a FastAPI dependency (:data:`State`).

It holds the engine, the served name, the admission rules, the metrics, the stored
responses (``/v1/responses``), and the checks and
steps the completion routes share: a body's fields and model, the sampling parameters
against the engine, the submission, a response's context.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import BaseModel

from pagedinfer.domain.limits import RequestLimits
from pagedinfer.domain.reasoning import ReasoningEnd
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.engine.async_engine import AsyncEngine, AsyncRequestStream
from pagedinfer.engine.prompts import TokenizedPrompt
from pagedinfer.errors import InvalidStructuredOutputError
from pagedinfer.serving.errors import OpenAIError
from pagedinfer.serving.fields import FieldPolicy
from pagedinfer.serving.generation_defaults import apply_generation_defaults, request_defaults
from pagedinfer.serving.lora import ServedLoRAs
from pagedinfer.serving.metrics import ServerMetrics
from pagedinfer.serving.options import ServingOptions
from pagedinfer.serving.prompts import ChatRendering
from pagedinfer.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
    chat_template_kwargs,
    check_fields,
)
from pagedinfer.serving.reasoning import ReasoningParser, get_reasoning_parser
from pagedinfer.serving.reasoning.plan import reasoning_end
from pagedinfer.serving.responses import ResponseContext
from pagedinfer.serving.responses_api.store import ResponseStore
from pagedinfer.serving.structured import StructuredRequest

__all__ = ["ServingState", "State", "serving_state"]


@dataclass(frozen=True, slots=True)
class ServingState:
    """The app's dependencies: one engine served under one name, by one set of rules."""

    engine: AsyncEngine
    served_model_name: str
    options: ServingOptions
    metrics: ServerMetrics
    created: int  # when the server started (the model card's "created")
    limits: RequestLimits
    vocab_size: int
    policy: FieldPolicy
    token_text: Callable[[int], str]  # one token's text (logprobs)
    decode: Callable[[Sequence[int]], str]  # token ids' text
    end_texts: tuple[str, ...]  # the EOS tokens' texts
    # The model's generation_config.json defaults, for the fields a request leaves out.
    sampling_defaults: dict[str, Any]
    reasoning: ReasoningParser | None = None  # --reasoning-parser
    reasoning_end: ReasoningEnd | None = None  # its end marker's token
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses kept
    loras: ServedLoRAs = field(default_factory=ServedLoRAs)  # adapters, by model name

    @classmethod
    def build(
        cls, engine: AsyncEngine, served_model_name: str, options: ServingOptions
    ) -> ServingState:
        sync_engine = engine.engine
        reasoning = None
        if options.reasoning_parser is not None:
            reasoning = get_reasoning_parser(options.reasoning_parser)
        return cls(
            engine=engine,
            served_model_name=served_model_name,
            options=options,
            metrics=ServerMetrics(speculative=sync_engine.speculation is not None),
            created=int(time.time()),
            limits=engine.request_limits,
            vocab_size=sync_engine.model_config.vocab_size,
            policy=FieldPolicy(ignore_unknown=options.ignore_unknown_fields),
            token_text=_token_text(engine),
            decode=_decode(engine),
            end_texts=_eos_texts(engine),
            sampling_defaults=request_defaults(sync_engine.config),
            reasoning=reasoning,
            reasoning_end=reasoning_end(
                reasoning, engine.tokenizer, sync_engine.model_config.vocab_size
            ),
        )

    def rejected(self, status: int) -> None:
        """Count a request answered with an error ``status`` before it ran."""
        self.metrics.requests_rejected.labels(status=str(status)).inc()

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name and self.loras.get(name) is None:
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist: this server serves "
                f"`{self.served_model_name}` and its adapters (GET /v1/models).",
                param="model",
                code="model_not_found",
            )

    def response_model(self, name: str | None) -> str:
        """The ``model`` a response names: the adapter asked for, else the served name."""
        lora = self.loras.get(name)
        return self.served_model_name if lora is None else lora.lora_name

    def admit(self, body: BaseModel) -> None:
        """The checks every body passes first: its fields, its model."""
        check_fields(
            body, self.policy, trust_request_chat_template=self.options.trust_request_chat_template
        )
        self.check_model(getattr(body, "model", None))
        apply_generation_defaults(body, self.sampling_defaults)

    def rendering(self, body: ChatCompletionRequest | TokenizeChatRequest) -> ChatRendering:
        return ChatRendering(
            chat_template=body.chat_template or self.options.chat_template,
            template_kwargs=chat_template_kwargs(body),
            add_generation_prompt=body.generation_prompt,
            add_special_tokens=body.add_special_tokens,
        )

    async def checked(
        self, params: SamplingParams, structured: StructuredRequest | None
    ) -> SamplingParams:
        """``params`` if the engine can serve them; a constraint is compiled (and its errors
        found) in a worker thread, off the event loop."""
        if structured is None:
            return self.engine.check_sampling_params(params)
        try:
            return await asyncio.to_thread(self.engine.check_sampling_params, params)
        except InvalidStructuredOutputError as error:
            raise structured.error(error) from None

    def submit(
        self,
        prompt: TokenizedPrompt,
        params: SamplingParams,
        structured: StructuredRequest | None,
        model: str | None = None,
    ) -> AsyncRequestStream:
        """Queue one prompt, with the LoRA adapter served as ``model`` (if one is)."""
        try:
            return self.engine.generate(prompt, params, lora_request=self.loras.get(model))
        except InvalidStructuredOutputError as error:
            if structured is None:
                raise
            raise structured.error(error) from None

    def context(
        self,
        prefix: str,
        params: SamplingParams,
        body: CompletionRequest | ChatCompletionRequest,
        **fields: Any,
    ) -> ResponseContext:
        return ResponseContext(
            response_id=f"{prefix}-{body.request_id or uuid.uuid4().hex}",
            model=self.response_model(body.model),
            created=int(time.time()),
            token_text=self.token_text,
            num_logprobs=params.logprobs,
            return_token_ids=bool(body.return_token_ids),
            decode=self.decode,
            prompt_logprobs=body.prompt_logprobs is not None,
            tokens_as_ids=bool(body.return_tokens_as_token_ids),
            continuous_usage=body.stream and body.continuous_usage,
            prompt_tokens_details=self.options.enable_prompt_tokens_details,
            min_characters=body.min_characters if body.stream else 0,
            **fields,
        )

    def redactor(self) -> Callable[[str], str]:
        """Replaces the checkpoint's path (as given and absolute) in client-facing messages
        by the served name: the path stays on the server."""
        given = self.engine.engine.config.model_path
        paths = sorted({given, os.path.abspath(given)}, key=len, reverse=True)
        served_model_name = self.served_model_name

        def redact(message: str) -> str:
            for path in paths:
                message = message.replace(path, served_model_name)
            return message

        return redact


async def serving_state(request: Request) -> ServingState:
    """The app's :class:`ServingState` (a FastAPI dependency; async, so it runs on the event
    loop, not in a thread)."""
    state: ServingState = request.app.state.serving
    return state


State = Annotated[ServingState, Depends(serving_state)]
"""A route's parameter ``state: State`` receives the app's :class:`ServingState`."""


def _decode(engine: AsyncEngine) -> Callable[[Sequence[int]], str]:
    tokenizer = engine.tokenizer

    def decode(token_ids: Sequence[int]) -> str:
        text: str = tokenizer.decode(list(token_ids)) if tokenizer is not None else ""
        return text

    return decode


def _eos_texts(engine: AsyncEngine) -> tuple[str, ...]:
    """The text of each EOS token (an answer decoded with its special tokens ends with one,
    which a tool-call parser leaves out)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return ()
    eos_ids = engine.engine.model_config.eos_token_ids
    return tuple(text for text in (tokenizer.decode([i]) for i in eos_ids) if text)


def _token_text(engine: AsyncEngine) -> Callable[[int], str]:
    tokenizer = engine.tokenizer

    def token_text(token_id: int) -> str:
        if tokenizer is None:
            return f"token_id:{token_id}"
        text: str = tokenizer.decode([token_id])
        return text

    return token_text
