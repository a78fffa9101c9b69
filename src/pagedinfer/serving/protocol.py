"""The OpenAI request bodies the server accepts, and their translation into ``SamplingParams``.

Request bodies are parsed by pydantic models that follow OpenAI's names, plus the vLLM
extensions a vLLM user reaches for (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``allowed_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``return_token_ids``,
``return_tokens_as_token_ids``, ``prompt_logprobs``, ``truncate_prompt_tokens``,
``add_special_tokens``, ``request_id``; for chat ``echo``, ``add_generation_prompt``,
``continue_final_message``, ``chat_template``, ``chat_template_kwargs``, ``documents``,
``reasoning_effort``, ``include_reasoning``, ``return_prompt_text``). Structured outputs
(``response_format``, ``structured_outputs``, ``guided_*``) are read by
:mod:`pagedinfer.serving.structured`, tools (``tools``, ``tool_choice``,
``parallel_tool_calls``) by :mod:`pagedinfer.serving.tools`.
Fields the models do not declare land in ``model_extra`` and :func:`check_fields` decides
about them with the tables of :mod:`pagedinfer.serving.fields`: a field is implemented,
refused with a 400 that names it, ignored with a logged warning (metadata only), or unknown
(a 400): none is dropped silently.

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
from typing import Annotated, Any, Literal

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
from pagedinfer.domain.sampling import MAX_SEED, SamplingParams
from pagedinfer.domain.structured import StructuredOutputsParams
from pagedinfer.errors import InvalidRequestError
from pagedinfer.serving.fields import (
    CHAT,
    COMPLETIONS,
    TOKENIZE_CHAT,
    TOKENIZE_COMPLETION,
    FieldPolicy,
    RequestFieldError,
)
from pagedinfer.serving.tools.choice import template_messages, template_tools

__all__ = [
    "LOGIT_BIAS_LIMIT",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "RequestFieldError",
    "StreamOptions",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "chat_messages",
    "chat_sampling_params",
    "chat_template_kwargs",
    "check_fields",
    "check_sizes",
    "completion_prompts",
    "completion_sampling_params",
    "echo_prefix",
    "echoes_prompt_only",
    "request_seed",
    "response_role",
    "truncation_limit",
]


# OpenAI's range of a logit_bias value.
LOGIT_BIAS_LIMIT = 100.0
_INT64 = 2**63
# The longest client-chosen request_id (it becomes part of the response's id).
MAX_REQUEST_ID_LENGTH = 256


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
Int64 = Annotated[int, Field(ge=-_INT64, le=_INT64 - 1)]
Bias = Annotated[Float32, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]
TokenId = Annotated[int, Field(ge=0, lt=_INT64)]


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
    # strict: JSON types are not coerced ("10" is no integer, "yes" no boolean). Undeclared
    # fields are kept (model_extra) for check_fields to judge: none is dropped silently.
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Request):
    """``stream_options``. ``include_usage`` left out follows ``continuous_usage_stats``
    (vLLM's extension: usage in every chunk, which implies the final usage chunk);
    ``min_characters`` (vLLM's) buffers each choice's deltas until that many characters."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None
    # vLLM's: hold a choice's streamed text until at least this many characters are new
    # (its last chunk sends what is left).
    min_characters: Annotated[int, Field(ge=0, le=_INT64 - 1)] | None = None

    @property
    def usage(self) -> bool:
        if self.include_usage is not None:
            return self.include_usage
        return bool(self.continuous_usage_stats)

    @property
    def continuous_usage(self) -> bool:
        return self.usage and bool(self.continuous_usage_stats)


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
    # vLLM's extensions (pass them with the openai client's extra_body).
    top_k: Int64 | None = None
    min_p: Float32 | None = None
    repetition_penalty: Float32 | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    stop_token_ids: list[Int64] | None = None
    allowed_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: Int64 | None = None
    truncate_prompt_tokens: Int64 | None = None
    truncation_side: Literal["left", "right"] | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID_LENGTH)] | None = None
    # Structured outputs (pagedinfer.serving.structured reads them): OpenAI's, vLLM's, and
    # vLLM's older guided_* spellings.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    structural_tag: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage

    @property
    def min_characters(self) -> int:
        """``stream_options.min_characters`` (0: every delta is sent as it comes)."""
        options = self.stream_options
        return 0 if options is None or options.min_characters is None else options.min_characters

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        **overrides: Any,
    ) -> SamplingParams:
        if prompt_logprobs is None:
            prompt_logprobs = self.prompt_logprobs
        if self.prompt_logprobs is not None and self.stream:
            raise _bad("prompt_logprobs", "prompt_logprobs are not available with stream=true")
        fields: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "stop": () if self.stop is None else self.stop,
            "seed": request_seed(self.seed),
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids or (),
            "allowed_token_ids": self.allowed_token_ids,
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
        fields.update(overrides)
        return SamplingParams(**fields)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: PromptField
    # OpenAI's default for completions (vLLM's too); null means "until max_model_len".
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    best_of: Int64 | None = None
    add_special_tokens: bool = True
    # vLLM's beam search (n beams; pagedinfer.serving.beam_search).
    use_beam_search: bool = False
    length_penalty: Float32 = 1.0

    @property
    def output_tokens(self) -> int | None:
        """The most tokens the request generates (``None``: until ``max_model_len``)."""
        if self.echo and self.max_tokens == 0:
            return 1
        return self.max_tokens


class ChatMessage(_Request):
    """One message. Fields beyond these (``tool_calls``, ``tool_call_id``,
    ``reasoning_content``, ...) reach the chat template as they are."""

    role: str
    content: ContentField | None = None
    name: str | None = None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class _ChatTemplateFields(_Request):
    """How a conversation is rendered (chat completions and ``/tokenize``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's function tools: checked by pagedinfer.serving.tools and given to the template.
    tools: list[Any] | None = None

    @property
    def generation_prompt(self) -> bool:
        """``add_generation_prompt``, off when ``continue_final_message`` asks to continue
        the last message (setting both to true is a 400: :func:`check_fields`)."""
        return self.add_generation_prompt and not self.continue_final_message


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    """``POST /v1/chat/completions``."""

    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    # vLLM's extensions: the new message starts with the last one's content when its role is
    # the response's; template variables; the rendered prompt in the response.
    echo: bool = False
    documents: list[dict[str, str]] | None = None
    reasoning_effort: ReasoningEffort | None = None
    # With --reasoning-parser: false leaves the reasoning out of the answer.
    include_reasoning: bool = True
    return_prompt_text: bool | None = None
    # Tool calling (pagedinfer.serving.tools): "none", "auto", "required" or a named function.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @property
    def output_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeCompletionRequest(_Request):
    """``POST /tokenize`` with a ``prompt`` (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = None


class TokenizeChatRequest(_ChatTemplateFields):
    """``POST /tokenize`` with ``messages`` (vLLM's shape)."""

    model: str | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[TokenId]


# ------------------------------------------------------------------------------ fields
_ENDPOINTS: dict[type[BaseModel], str] = {
    CompletionRequest: COMPLETIONS,
    ChatCompletionRequest: CHAT,
    TokenizeCompletionRequest: TOKENIZE_COMPLETION,
    TokenizeChatRequest: TOKENIZE_CHAT,
    DetokenizeRequest: TOKENIZE_COMPLETION,
}


def check_fields(
    request: BaseModel, policy: FieldPolicy, *, trust_request_chat_template: bool = False
) -> None:
    """Refuse the fields of ``request`` the server cannot serve (400 naming the field) and
    warn about the ignored ones (:mod:`pagedinfer.serving.fields`). Also: ``stream_options``
    needs ``stream: true`` (vLLM's rule), and a ``chat_template`` in a request needs the
    server's ``--trust-request-chat-template`` (as vLLM: a template is code the server
    runs)."""
    endpoint = _ENDPOINTS[type(request)]
    policy.check(endpoint, request.model_extra)
    if isinstance(request, _SamplingFields) and request.stream_options is not None:
        policy.check(endpoint, request.stream_options.model_extra, prefix="stream_options.")
        if not request.stream and request.stream_options.model_fields_set:
            raise _bad("stream_options", "stream_options can only be given with stream=true")
    if isinstance(request, _ChatTemplateFields):
        if request.chat_template is not None and not trust_request_chat_template:
            raise _bad(
                "chat_template",
                "a chat template sent with the request is refused: this server renders chats "
                "with its own template (the operator can allow request templates with "
                "--trust-request-chat-template)",
            )
        if (
            request.continue_final_message
            and request.add_generation_prompt
            and "add_generation_prompt" in request.model_fields_set
        ):
            raise _bad(
                "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true: set "
                "add_generation_prompt to false to continue the last message",
            )


def request_seed(seed: int | None) -> int | None:
    """The ``SamplingParams.seed`` of a request's ``seed``: ``-1`` is unseeded (vLLM's rule),
    other negative seeds (vLLM takes any signed 64-bit seed) are taken modulo 2**63, so
    ``-5`` samples as ``2**63 - 5`` does."""
    if seed is None or seed == -1:
        return None
    return seed & MAX_SEED


# -------------------------------------------------------------------------- completions
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


def completion_sampling_params(
    request: CompletionRequest, structured_outputs: StructuredOutputsParams | None = None
) -> SamplingParams:
    """The request's ``SamplingParams`` (``structured_outputs``: the constraint its fields ask
    for, :mod:`pagedinfer.serving.structured`). ``echo`` asks for the prompt's logprobs too
    when ``logprobs`` is set, and with ``max_tokens=0`` (the prompt alone, as vLLM serves it)
    one token is generated and dropped."""
    if request.best_of is not None and request.best_of != request.n:
        raise _bad("best_of", "best_of must equal n (or be left out)")
    logprobs = request.logprobs
    prompt_logprobs = None
    if request.echo and logprobs is not None:
        prompt_logprobs = max(logprobs, request.prompt_logprobs or 0)
    return request._sampling_params(
        request.output_tokens, logprobs, prompt_logprobs, structured_outputs=structured_outputs
    )


def echoes_prompt_only(request: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens=0``: the response holds the prompt and nothing generated."""
    return request.echo and request.max_tokens == 0


def truncation_limit(
    request: CompletionRequest | ChatCompletionRequest, max_model_len: int
) -> int | None:
    """How many prompt tokens ``truncate_prompt_tokens`` keeps (``None``: no truncation).

    vLLM's rule: ``k`` keeps the last ``k`` tokens (the first ``k`` with
    ``truncation_side: "right"``), ``-1`` as many as fit beside ``max_tokens`` in
    ``max_model_len``, and a ``k`` above that is a 400.
    """
    requested = request.truncate_prompt_tokens
    if requested is None:
        return None
    output = request.output_tokens
    budget = max_model_len - (1 if output is None else max(output, 1))
    if budget < 1:
        raise _bad(
            "truncate_prompt_tokens",
            f"max_tokens={output} leaves no room for a prompt in max_model_len={max_model_len}: "
            "ask for fewer tokens",
        )
    if requested == -1:
        return budget
    if requested < 1:
        raise _bad(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens must be -1 (as many as fit) or at least 1, got {requested}",
        )
    if requested > budget:
        raise _bad(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens={requested} is more than max_model_len - max_tokens = "
            f"{budget}: ask for at most {budget} (or -1)",
        )
    return requested


# --------------------------------------------------------------------------------- chat
def chat_sampling_params(
    request: ChatCompletionRequest,
    structured_outputs: StructuredOutputsParams | None = None,
    *,
    keep_special_tokens: bool = False,
) -> SamplingParams:
    """The request's ``SamplingParams``: ``structured_outputs`` is the constraint its fields
    or its tools ask for; ``keep_special_tokens`` (a tool-call parser whose markers are
    special tokens) decodes them unless the request sets ``skip_special_tokens``."""
    top = request.top_logprobs
    if top is not None and top > 0 and not request.logprobs:
        raise _bad("top_logprobs", "top_logprobs needs logprobs=true")
    logprobs = (top or 0) if request.logprobs else None
    overrides: dict[str, Any] = {"structured_outputs": structured_outputs}
    if keep_special_tokens and "skip_special_tokens" not in request.model_fields_set:
        overrides["skip_special_tokens"] = False
    return request._sampling_params(request.output_tokens, logprobs, **overrides)


def chat_messages(request: _ChatTemplateFields) -> list[dict[str, Any]]:
    """The conversation as the chat template expects it: text content parts joined; the
    ``arguments`` of an assistant message's ``tool_calls`` parsed from their JSON text (as
    HF templates take them); other fields of a message (``tool_call_id``, ...) passed on as
    they are."""
    messages = []
    for message in request.messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(_text_part(part) for part in content)
        rendered: dict[str, Any] = {**(message.model_extra or {})}
        rendered.update(role=message.role, content=content or "")
        if message.name is not None:
            rendered["name"] = message.name
        messages.append(rendered)
    return template_messages(messages)


def chat_template_kwargs(request: _ChatTemplateFields) -> dict[str, Any] | None:
    """The template's variables: ``chat_template_kwargs``, then ``tools`` (checked), and
    (vLLM's) ``documents``, ``continue_final_message`` and ``reasoning_effort`` (which also
    turns thinking on or off through ``enable_thinking``, unless ``chat_template_kwargs``
    sets it)."""
    kwargs: dict[str, Any] = dict(request.chat_template_kwargs or {})
    tools = template_tools(request.tools)
    if tools is not None:
        kwargs["tools"] = tools
    if request.continue_final_message:
        kwargs["continue_final_message"] = True
    if isinstance(request, ChatCompletionRequest):
        if request.documents is not None:
            kwargs["documents"] = request.documents
        effort = request.reasoning_effort
        if effort is not None:
            kwargs["reasoning_effort"] = effort
            kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs or None


def response_role(request: ChatCompletionRequest) -> str:
    """The role of the answer: ``assistant``, or the last message's when the template adds
    no generation prompt (the model continues that turn), as vLLM."""
    return "assistant" if request.generation_prompt else request.messages[-1].role


def echo_prefix(request: ChatCompletionRequest) -> str:
    """With ``echo``, what the answer starts with: the last message's content when its role
    is the answer's (vLLM's rule), else nothing."""
    if not request.echo:
        return ""
    last = request.messages[-1]
    if last.role != response_role(request):
        return ""
    content = last.content
    if isinstance(content, list):
        return "".join(_text_part(part) for part in content)
    return content or ""


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


# -------------------------------------------------------------------------------- sizes
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
        ("allowed_token_ids", len(request.allowed_token_ids or ())),
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
