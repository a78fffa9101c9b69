"""No request field is dropped silently: every field is implemented, refused (400 naming it),
ignored with one logged warning (metadata), or unknown (400, or a warning on request). Also the
smaller vLLM rules of the request schema: seeds, truncation, chat rendering flags."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import pytest

from pagedinfer.domain.sampling import MAX_SEED
from pagedinfer.serving.fields import IGNORED, UNSUPPORTED, FieldPolicy
from pagedinfer.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestFieldError,
    TokenizeChatRequest,
    chat_messages,
    chat_template_kwargs,
    check_fields,
    completion_sampling_params,
    echo_prefix,
    request_seed,
    response_role,
    truncation_limit,
)
from pagedinfer.serving.responses_api.request import ResponsesRequest

MESSAGES = [{"role": "user", "content": "x"}]


def _completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def _check(request: Any, policy: FieldPolicy | None = None, **options: bool) -> None:
    check_fields(request, policy or FieldPolicy(), **options)


# Values that ask for a feature pagedinfer lacks (one per refused field).
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
REFUSED: dict[str, Any] = {
    "use_beam_search": True,
    "length_penalty": 0.5,
    "early_stopping": True,
    "watermarking": True,
    "bad_words": ["x"],
    "logprob_token_ids": [1],
    "logits_processors": ["m.f"],
    "priority": 1,
    "cache_salt": "salt",
    "kv_transfer_params": {"do_remote_decode": True},
    "ec_transfer_params": {"x": 1},
    "vllm_xargs": {"x": 1},
    "repetition_detection": {"max_pattern_size": 3},
    "thinking_token_budget": 10,
    "spaces_between_special_tokens": False,
    "mm_processor_kwargs": {"x": 1},
    "media_io_kwargs": {"image": {}},
    "suffix": "!",
    "prompt_embeds": "AAAA",
    "functions": [TOOL["function"]],
    "function_call": {"name": "f"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "verbosity": "low",
    "moderation": {"x": 1},
    "background": True,
    "include": ["reasoning.encrypted_content"],
    "conversation": "conv_1",
    "prompt": {"id": "pmpt_1"},
    "max_tool_calls": 3,
    "top_logprobs": 2,
    "truncation": "auto",
    "background_options": {"x": 1},
    "context_management": [{"type": "compaction"}],
    "access_programs": {"x": 1},
    "image": {"size": "auto"},
}
# What clients send when they want none of it: accepted.
HARMLESS: dict[str, list[Any]] = {
    "use_beam_search": [False],
    "length_penalty": [1, 1.0],
    "priority": [0],
    "thinking_token_budget": [-1, None],
    "spaces_between_special_tokens": [True],
    "function_call": ["none", "auto"],
    "modalities": [["text"]],
    "bad_words": [[]],
    "suffix": [None, ""],
    "background": [False],
    "include": [[]],
    "top_logprobs": [0],
    "truncation": ["disabled"],
}


@pytest.mark.parametrize(
    ("endpoint", "field"), [(e, f) for e in UNSUPPORTED for f in UNSUPPORTED[e]]
)
def test_unsupported_fields_asking_for_something_are_refused_by_name(
    endpoint: str, field: str
) -> None:
    policy = FieldPolicy()
    with pytest.raises(RequestFieldError, match=f"{field} is not supported") as error:
        policy.check(endpoint, {field: REFUSED[field]})
    assert error.value.param == field
    for value in [None, *HARMLESS.get(field, [])]:
        policy.check(endpoint, {field: value})  # asks for nothing


def test_refused_fields_reach_the_checks_from_a_parsed_body() -> None:
    with pytest.raises(RequestFieldError, match="send tools and tool_choice") as error:
        _check(_chat(functions=[TOOL["function"]]))
    assert error.value.param == "functions"
    with pytest.raises(RequestFieldError, match="beam search") as error:
        _check(_chat(use_beam_search=True))  # served on /v1/completions only
    assert error.value.param == "use_beam_search"
    with pytest.raises(RequestFieldError, match="insertion") as error:
        _check(_completion(suffix="!"))
    assert error.value.param == "suffix"
    _check(_chat(tools=[], tool_choice="none", response_format={"type": "text"}))


def test_metadata_fields_are_ignored_with_one_warning_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = FieldPolicy()
    with caplog.at_level(logging.WARNING, logger="pagedinfer.serving"):
        for _ in range(3):
            _check(_chat(user="u1", metadata={"a": "b"}, store=True), policy)
    warned = [record.getMessage() for record in caplog.records]
    assert len(warned) == 2 + 1 and all("ignored" in message for message in warned)
    assert any("'user'" in message for message in warned)
    assert "parallel_tool_calls" not in IGNORED["chat"]  # served (tool calling)


def test_unknown_fields_are_refused_as_openai_does_or_logged_on_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(
        RequestFieldError, match="Unrecognized request argument supplied: maxtokens"
    ):
        _check(_completion(maxtokens=5))
    with pytest.raises(RequestFieldError) as error:
        _check(_completion(stream=True, stream_options={"include_usage": True, "x": 1}))
    assert error.value.param == "stream_options.x"
    # A field of the other endpoint is unknown here.
    with pytest.raises(RequestFieldError, match="suffix"):
        _check(_chat(suffix="!"))
    with pytest.raises(RequestFieldError, match="messages"):
        _check(_completion(messages=MESSAGES))
    policy = FieldPolicy(ignore_unknown=True)
    with caplog.at_level(logging.WARNING, logger="pagedinfer.serving"):
        _check(_completion(maxtokens=5, frobnicate=True), policy)
    assert len(caplog.records) == 2
    # OpenAI's stream_options.include_obfuscation only pads chunks: ignored.
    _check(_completion(stream=True, stream_options={"include_obfuscation": False}))


def _client_parameters(method: Any) -> set[str]:
    skip = {"self", "extra_body", "extra_headers", "extra_query", "timeout"}
    return set(inspect.signature(method).parameters) - skip


def _known(model: type[Any], endpoint: str) -> set[str]:
    return set(model.model_fields) | set(UNSUPPORTED[endpoint]) | IGNORED[endpoint]


def test_every_parameter_of_the_openai_client_is_known() -> None:
    """Whatever the official client sends, the server never calls it unknown."""
    openai = pytest.importorskip("openai")
    chat = _client_parameters(openai.resources.chat.completions.Completions.create)
    completions = _client_parameters(openai.resources.completions.Completions.create)
    assert chat - _known(ChatCompletionRequest, "chat") == set()
    assert completions - _known(CompletionRequest, "completions") == set()
    from openai.resources.responses.responses import Responses

    responses = _client_parameters(Responses.create)
    assert responses - _known(ResponsesRequest, "responses") == set()


# vLLM's request fields (vllm/entrypoints/openai/{completion,chat_completion}/protocol.py),
# and the ones older vLLM versions had (best_of, guided_*, logits_processors).
VLLM_SHARED = """model frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed
stop stream stream_options temperature top_p user use_beam_search top_k min_p
repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output
ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens
truncation_side allowed_token_ids prompt_logprobs logprob_token_ids bad_words
add_special_tokens response_format structured_outputs priority request_id session_id
return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets
return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs
repetition_detection thinking_token_budget stream_interval echo guided_json guided_regex
guided_choice guided_grammar guided_decoding_backend guided_whitespace_pattern structural_tag
logits_processors""".split()  # noqa: SIM905
VLLM_COMPLETIONS = ["prompt", "suffix", "prompt_embeds", "best_of"]
VLLM_CHAT = """messages top_logprobs max_completion_tokens tools tool_choice reasoning_effort
include_reasoning parallel_tool_calls add_generation_prompt continue_final_message documents
chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs return_prompt_text
early_stopping""".split()  # noqa: SIM905


def test_every_vllm_field_is_known() -> None:
    assert {*VLLM_SHARED, *VLLM_COMPLETIONS} - _known(CompletionRequest, "completions") == set()
    assert {*VLLM_SHARED, *VLLM_CHAT} - _known(ChatCompletionRequest, "chat") == set()


def test_stream_options_need_a_stream() -> None:
    with pytest.raises(RequestFieldError, match="stream=true") as error:
        _check(_completion(stream_options={"include_usage": True}))
    assert error.value.param == "stream_options"
    _check(_completion(stream_options=None))
    _check(_chat(stream=True, stream_options={"include_usage": True}))


def test_continuous_usage_implies_usage_unless_refused() -> None:
    def options(**fields: Any) -> tuple[bool, bool]:
        request = _completion(stream=True, stream_options=fields)
        return request.include_usage, request.continuous_usage

    assert options() == (False, False)
    assert options(include_usage=True) == (True, False)
    assert options(continuous_usage_stats=True) == (True, True)
    assert options(include_usage=True, continuous_usage_stats=True) == (True, True)
    assert options(include_usage=False, continuous_usage_stats=True) == (False, False)


# ------------------------------------------------------------------------------ seeds
@pytest.mark.parametrize(
    ("seed", "expected"),
    [
        (None, None),
        (-1, None),  # vLLM: unseeded
        (0, 0),
        (7, 7),
        (MAX_SEED, MAX_SEED),
        (-5, 2**63 - 5),
        (-(2**63), 0),
    ],
)
def test_signed_64_bit_seeds_are_accepted(seed: int | None, expected: int | None) -> None:
    assert request_seed(seed) == expected
    assert completion_sampling_params(_completion(seed=seed)).seed == expected


# ------------------------------------------------------------------------- truncation
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"truncate_prompt_tokens": 10}, 10),
        ({"truncate_prompt_tokens": 84}, 84),  # 100 - max_tokens 16
        ({"truncate_prompt_tokens": -1}, 84),
        ({"truncate_prompt_tokens": -1, "max_tokens": None}, 99),
        ({"truncate_prompt_tokens": -1, "max_tokens": 0, "echo": True}, 99),
    ],
)
def test_truncation_keeps_what_fits_beside_max_tokens(
    fields: dict[str, Any], expected: int | None
) -> None:
    assert truncation_limit(_completion(**fields), max_model_len=100) == expected


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"truncate_prompt_tokens": 85}, "at most 84"),
        ({"truncate_prompt_tokens": 0}, "at least 1"),
        ({"truncate_prompt_tokens": -2}, "at least 1"),
        ({"truncate_prompt_tokens": 5, "max_tokens": 100}, "no room"),
    ],
)
def test_truncation_beyond_the_context_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestFieldError, match=message) as error:
        truncation_limit(_completion(**fields), max_model_len=100)
    assert error.value.param == "truncate_prompt_tokens"
    chat = _chat(truncate_prompt_tokens=60, max_completion_tokens=50)
    with pytest.raises(RequestFieldError, match="at most 50"):
        truncation_limit(chat, max_model_len=100)


# ------------------------------------------------------------------------------- chat
def test_chat_template_variables_follow_vllms_fields() -> None:
    assert chat_template_kwargs(_chat()) is None
    kwargs = chat_template_kwargs(
        _chat(
            chat_template_kwargs={"enable_thinking": True, "x": 1},
            reasoning_effort="none",
            documents=[{"title": "t", "text": "d"}],
        )
    )
    assert kwargs == {
        "enable_thinking": True,  # the client's own setting wins
        "x": 1,
        "reasoning_effort": "none",
        "documents": [{"title": "t", "text": "d"}],
    }
    assert chat_template_kwargs(_chat(reasoning_effort="high")) == {
        "reasoning_effort": "high",
        "enable_thinking": True,
    }
    assert chat_template_kwargs(_chat(reasoning_effort="none"))["enable_thinking"] is False


def test_continue_final_message_continues_the_last_turn() -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "An apple a day"}]
    request = ChatCompletionRequest.model_validate(
        {"messages": messages, "continue_final_message": True, "echo": True}
    )
    _check(request)
    assert not request.generation_prompt
    assert chat_template_kwargs(request) == {"continue_final_message": True}
    assert response_role(request) == "assistant"
    assert echo_prefix(request) == "An apple a day"
    both = {"messages": messages, "continue_final_message": True, "add_generation_prompt": True}
    with pytest.raises(RequestFieldError, match="cannot both be true") as error:
        _check(ChatCompletionRequest.model_validate(both))
    assert error.value.param == "continue_final_message"
    # echo repeats only a message of the answer's role.
    assert echo_prefix(_chat(echo=True)) == ""
    no_prompt = _chat(add_generation_prompt=False, echo=True)
    assert response_role(no_prompt) == "user" and echo_prefix(no_prompt) == "x"


def test_a_chat_template_in_the_request_needs_the_operators_trust() -> None:
    request = _chat(chat_template="{{ messages[0].content }}")
    with pytest.raises(RequestFieldError, match="--trust-request-chat-template") as error:
        _check(request)
    assert error.value.param == "chat_template"
    _check(request, trust_request_chat_template=True)
    tokenize = TokenizeChatRequest.model_validate({"messages": MESSAGES, "chat_template": "x"})
    with pytest.raises(RequestFieldError):
        _check(tokenize)


def test_other_message_fields_reach_the_template() -> None:
    """Fields beyond role and content pass through; a tool call's arguments (OpenAI's JSON
    string) reach the template as an object, as HF templates expect them (vLLM's rule)."""
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ]
    request = ChatCompletionRequest.model_validate({"messages": messages})
    parsed = {**call, "function": {"name": "f", "arguments": {"a": 1}}}
    assert chat_messages(request) == [
        {"role": "assistant", "content": "", "tool_calls": [parsed]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ]
    assert messages[0]["tool_calls"] == [call]  # the request is not changed
