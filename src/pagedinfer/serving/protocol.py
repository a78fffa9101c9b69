"""The OpenAI request bodies the server accepts, and their translation into ``SamplingParams``.

Request bodies are parsed by pydantic models that follow OpenAI's names (plus the vLLM
extensions a vLLM user reaches for: ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``return_token_ids``, ``chat_template_kwargs``). Unknown
fields are ignored, as OpenAI-compatible servers do. Ranges are not checked here:
:class:`~pagedinfer.SamplingParams` checks every field when it is built, and its error (naming
the field) becomes the 400 response, so the server and the library cannot disagree on what
is allowed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.errors import InvalidRequestError

__all__ = [
    "MAX_LOGPROBS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "RequestFieldError",
    "StreamOptions",
    "chat_messages",
    "chat_sampling_params",
    "completion_prompts",
    "completion_sampling_params",
    "echoes_prompt_only",
]

# Most top log-probabilities a request may ask for per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


class RequestFieldError(InvalidRequestError):
    """A request field the server cannot serve; ``param`` names it for the error JSON."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields completions and chat share (OpenAI's names, then vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions (pass them with the openai client's extra_body).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    prompt_logprobs: int | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        if prompt_logprobs is None:
            prompt_logprobs = self.prompt_logprobs
        if self.prompt_logprobs is not None:
            if self.stream:
                raise _bad("prompt_logprobs", "prompt_logprobs are not available with stream=true")
            _check_logprobs("prompt_logprobs", self.prompt_logprobs)
        fields: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "stop": () if self.stop is None else self.stop,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids or (),
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
        }
        # A field left out (or null) keeps SamplingParams' default.
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if self.logit_bias:
            fields["logit_bias"] = _logit_bias(self.logit_bias)
        return SamplingParams(**fields)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default for completions (vLLM's too); null means "until max_model_len".
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's extensions: variables for the chat template (Qwen3's enable_thinking), and
    # whether the template appends the assistant turn's opening.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # Refused unless they ask for nothing (no tool-call parsing, no guided decoding): read
    # so that a client relying on them gets a 400, not free text it did not ask for.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: one text, several texts, token ids or several."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt is empty: give a string, strings or token ids.")
    if all(isinstance(item, int) for item in prompt):
        return [list(prompt)]  # type: ignore[arg-type]  # checked just above
    return list(prompt)  # type: ignore[arg-type]  # strings or token-id lists, by the model


def completion_sampling_params(request: CompletionRequest) -> SamplingParams:
    """The request's ``SamplingParams``. ``echo`` asks for the prompt's logprobs too when
    ``logprobs`` is set, and with ``max_tokens=0`` (the prompt alone, as vLLM serves it) one
    token is generated and dropped."""
    if request.suffix is not None:
        raise _bad("suffix", "suffix is not supported (no insertion models)")
    if request.best_of is not None and request.best_of != request.n:
        raise _bad("best_of", "best_of must equal n (or be left out)")
    logprobs = request.logprobs
    _check_logprobs("logprobs", logprobs)
    max_tokens = request.max_tokens
    prompt_logprobs = None
    if request.echo:
        if max_tokens == 0:
            max_tokens = 1
        if logprobs is not None:
            prompt_logprobs = max(logprobs, request.prompt_logprobs or 0)
    return request._sampling_params(max_tokens, logprobs, prompt_logprobs)


def echoes_prompt_only(request: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens=0``: the response holds the prompt and nothing generated."""
    return request.echo and request.max_tokens == 0


def chat_sampling_params(request: ChatCompletionRequest) -> SamplingParams:
    if request.tools or request.functions:
        param = "tools" if request.tools else "functions"
        raise _bad(param, f"{param} are not supported: pagedinfer does not parse tool calls")
    if request.tool_choice not in (None, "none", "auto"):
        raise _bad("tool_choice", "tool_choice is not supported: pagedinfer does not call tools")
    if request.response_format is not None and request.response_format.get("type") != "text":
        raise _bad(
            "response_format",
            "response_format other than {'type': 'text'} is not supported (no guided decoding)",
        )
    max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = request.max_tokens
    top = request.top_logprobs
    _check_logprobs("top_logprobs", top)
    if top is not None and top > 0 and not request.logprobs:
        raise _bad("top_logprobs", "top_logprobs needs logprobs=true")
    logprobs = (top or 0) if request.logprobs else None
    return request._sampling_params(max_tokens, logprobs)


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as the chat template expects it: text content parts joined."""
    messages = []
    for message in request.messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(_text_part(part) for part in content)
        rendered: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            rendered["name"] = message.name
        messages.append(rendered)
    return messages


def _text_part(part: dict[str, Any]) -> str:
    if part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise _bad(
            "messages", f"only text content parts are supported, got type {part.get('type')!r}"
        )
    text: str = part["text"]
    return text


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError as error:
        raise _bad("logit_bias", "logit_bias keys must be token ids (integers)") from error


def _check_logprobs(param: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise _bad(param, f"{param} must be in [0, {MAX_LOGPROBS}], got {value}")


def _bad(param: str, message: str) -> RequestFieldError:
    return RequestFieldError(param, message + ".")
