"""The OpenAI request bodies the server accepts, and their translation into ``SamplingParams``.

Request bodies are parsed by pydantic models that follow OpenAI's names (plus the vLLM
extensions a vLLM user reaches for: ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``return_token_ids``, ``chat_template_kwargs``). Unknown
fields are ignored, as OpenAI-compatible servers do.

Types are strict (pydantic's strict mode): ``"max_tokens": "10"``, ``"stream": "yes"`` or
``"prompt": [true, false]`` are 400s, not coerced; a JSON integer is accepted where a number
is expected. Numbers the device computes with (temperature, the filters, penalties,
``logit_bias``) must be finite in float32, and ``logit_bias`` values are in OpenAI's
[-100, 100]. Other ranges are not checked here: :class:`~pagedinfer.SamplingParams` checks
every field when it is built, and its error (naming the field) becomes the 400 response, so
the server and the library cannot disagree on what is allowed. Sizes (``n``, stop strings,
``logit_bias`` entries, logprobs, the number of prompts) are compared with the engine's
:class:`~pagedinfer.domain.limits.RequestLimits` by :func:`check_sizes` before anything is
built from them.
"""

from __future__ import annotations

import math
import struct
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from pagedinfer.domain.limits import RequestLimits
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.errors import InvalidRequestError

__all__ = [
    "LOGIT_BIAS_LIMIT",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "RequestFieldError",
    "StreamOptions",
    "chat_messages",
    "chat_sampling_params",
    "check_sizes",
    "completion_prompts",
    "completion_sampling_params",
    "echoes_prompt_only",
]


class RequestFieldError(InvalidRequestError):
    """A request field the server cannot serve; ``param`` names it for the error JSON."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# OpenAI's range of a logit_bias value.
LOGIT_BIAS_LIMIT = 100.0
_INT64 = 2**63


def _float32(value: float) -> float:
    if math.isfinite(value):
        try:
            rounded = struct.unpack("<f", struct.pack("<f", value))[0]
        except OverflowError:  # rounds past the largest float32
            rounded = math.inf
        if math.isfinite(rounded) and (rounded != 0 or value == 0):
            return value
    raise PydanticCustomError(
        "float32",
        "Input should be a finite number that float32 holds: 0, or a magnitude in "
        "[1.4e-45, 3.4e38]",
    )


# A JSON number (integers accepted) the device computes with in float32.
Float32 = Annotated[float, AfterValidator(_float32)]
# A JSON integer that fits an int64 (token ids, counts and seeds reach int64 tensors).
Int64 = Annotated[int, Field(ge=-_INT64, lt=_INT64)]
Bias = Annotated[Float32, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]


def _one_of(expected: str) -> Any:
    """A union's errors (one per member) become one, naming what is expected."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("type", f"Input should be {expected}") from None

    return WrapValidator(validate)


PromptField = Annotated[
    str | list[str] | list[Int64] | list[list[Int64]],
    _one_of(
        "a string, a list of strings, a list of token ids (integers) or a list of token-id lists"
    ),
]
StopField = Annotated[str | list[str], _one_of("a string or a list of strings")]
ContentField = Annotated[
    str | list[dict[str, Any]], _one_of('a string or a list of {"type": "text"} parts')
]


class _Request(BaseModel):
    # strict: JSON types are not coerced ("10" is no integer, "yes" no boolean).
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields completions and chat share (OpenAI's names, then vLLM's extensions)."""

    model: str | None = None
    n: Int64 = 1
    temperature: Float32 | None = None
    top_p: Float32 | None = None
    stop: StopField | None = None
    seed: Int64 | None = None
    presence_penalty: Float32 | None = None
    frequency_penalty: Float32 | None = None
    logit_bias: dict[str, Bias] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions (pass them with the openai client's extra_body).
    top_k: Int64 | None = None
    min_p: Float32 | None = None
    repetition_penalty: Float32 | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    prompt_logprobs: Int64 | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        if prompt_logprobs is None:
            prompt_logprobs = self.prompt_logprobs
        if self.prompt_logprobs is not None and self.stream:
            raise _bad("prompt_logprobs", "prompt_logprobs are not available with stream=true")
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

    prompt: PromptField
    # OpenAI's default for completions (vLLM's too); null means "until max_model_len".
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None


class ChatMessage(_Request):
    role: str
    content: ContentField | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
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


def check_sizes(
    request: CompletionRequest | ChatCompletionRequest, limits: RequestLimits, vocab_size: int
) -> None:
    """Refuse a request that asks for more than the engine's limits, before anything is built
    from it: sizes are compared first (``len()``), in time independent of their values.

    A completion request starts ``n`` sequences per prompt; together they may not exceed
    ``max_n`` (one HTTP request starts at most ``max_n`` sequences).
    """
    n = request.n
    if n > limits.max_n:
        raise _over("n", f"n={n}", "max_n", limits.max_n, "--max-n")
    if isinstance(request, CompletionRequest):
        prompt = request.prompt
        num_prompts = 1 if isinstance(prompt, str) or _is_token_ids(prompt) else len(prompt)
        if num_prompts * n > limits.max_n:
            raise _bad(
                "prompt",
                f"{num_prompts} prompts with n={n} would start {num_prompts * n} sequences; one "
                f"request may start at most max_n={limits.max_n} (prompts x n): send fewer "
                "prompts per request (the operator can raise --max-n)",
            )
        logprobs = [("logprobs", request.logprobs)]
    else:
        logprobs = [("top_logprobs", request.top_logprobs)]
    logprobs.append(("prompt_logprobs", request.prompt_logprobs))
    max_logprobs = limits.max_logprobs_for(vocab_size)
    for param, value in logprobs:
        if value is not None and not 0 <= value <= max_logprobs:
            raise _bad(param, f"{param} must be in [0, {max_logprobs}], got {value}")
    stop = request.stop
    if isinstance(stop, list) and len(stop) > limits.max_stop:
        shown = f"stop has {len(stop)} strings"
        raise _over("stop", shown, "max_stop", limits.max_stop, "--max-stop")
    longest = max((len(text) for text in _strings(stop)), default=0)
    if longest > limits.max_stop_str_len:
        shown = f"stop has a string of {longest} characters"
        raise _over(
            "stop", shown, "max_stop_str_len", limits.max_stop_str_len, "--max-stop-str-len"
        )
    for param, size in (
        ("stop_token_ids", len(request.stop_token_ids or ())),
        ("logit_bias", len(request.logit_bias or ())),
    ):
        if size > vocab_size:
            raise _bad(
                param,
                f"{param} has {size} entries but the vocabulary has {vocab_size} tokens: name "
                "each token id at most once",
            )


def _strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else stop


def _is_token_ids(prompt: list[Any]) -> bool:
    return bool(prompt) and isinstance(prompt[0], int)


def _over(param: str, shown: str, limit: str, bound: int, flag: str) -> RequestFieldError:
    return _bad(
        param,
        f"{shown}: more than this server's {limit}={bound}. Ask for less (the operator can "
        f"raise {flag})",
    )


def _bad(param: str, message: str) -> RequestFieldError:
    return RequestFieldError(param, message + ".")
