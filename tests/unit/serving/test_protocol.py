"""Request bodies to SamplingParams and prompts, without a server."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from pagedinfer import SamplingParams
from pagedinfer.domain.limits import RequestLimits
from pagedinfer.errors import InvalidRequestError, InvalidSamplingParamsError
from pagedinfer.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestFieldError,
    chat_messages,
    chat_sampling_params,
    check_sizes,
    completion_prompts,
    completion_sampling_params,
    echoes_prompt_only,
)

REPO = Path(__file__).resolve().parents[3]


def test_completion_defaults_are_openais() -> None:
    params = completion_sampling_params(CompletionRequest(prompt="hi"))
    assert params == SamplingParams(max_tokens=16)  # OpenAI's completion default


def test_completion_fields_map_to_sampling_params() -> None:
    request = CompletionRequest.model_validate(
        {
            "prompt": "hi",
            "max_tokens": None,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": -1,
            "min_p": 0.1,
            "n": 3,
            "best_of": 3,
            "stop": "\n",
            "seed": 7,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"5": 1.5},
            "logprobs": 2,
            "ignore_eos": True,
            "min_tokens": 2,
            "stop_token_ids": [9],
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "allowed_token_ids": [3, 4, 9],
        }
    )
    assert completion_sampling_params(request) == SamplingParams(
        max_tokens=None,
        temperature=0.5,
        top_p=0.9,
        top_k=0,
        min_p=0.1,
        n=3,
        stop=("\n",),
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={5: 1.5},
        logprobs=2,
        ignore_eos=True,
        min_tokens=2,
        stop_token_ids=(9,),
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        allowed_token_ids=(3, 4, 9),
    )


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("text", ["text"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt: object, expected: list[object]) -> None:
    assert completion_prompts(CompletionRequest.model_validate({"prompt": prompt})) == expected


def test_bad_completion_fields_name_the_parameter() -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": {"not": "a prompt"}})
    with pytest.raises(InvalidRequestError):
        completion_prompts(CompletionRequest(prompt=[]))
    cases = {
        "best_of": {"best_of": 2},
        "logit_bias": {"logit_bias": {"x": 1.0}},
        "prompt_logprobs": {"prompt_logprobs": 1, "stream": True},
    }
    for param, fields in cases.items():
        with pytest.raises(RequestFieldError) as error:
            completion_sampling_params(CompletionRequest.model_validate({"prompt": "hi", **fields}))
        assert error.value.param == param
    with pytest.raises(InvalidSamplingParamsError, match="top_p"):
        completion_sampling_params(CompletionRequest(prompt="hi", top_p=0))


def test_echo_asks_for_the_prompts_logprobs() -> None:
    def params(**fields: object) -> SamplingParams:
        return completion_sampling_params(
            CompletionRequest.model_validate({"prompt": "hi", **fields})
        )

    assert params(echo=True) == SamplingParams(max_tokens=16)
    assert params(echo=True, logprobs=2) == SamplingParams(
        max_tokens=16, logprobs=2, prompt_logprobs=2
    )
    # max_tokens=0: the prompt alone; one token is generated (and dropped by the response).
    assert params(echo=True, max_tokens=0, logprobs=1) == SamplingParams(
        max_tokens=1, logprobs=1, prompt_logprobs=1
    )
    assert echoes_prompt_only(CompletionRequest(prompt="hi", echo=True, max_tokens=0))
    assert not echoes_prompt_only(CompletionRequest(prompt="hi", max_tokens=0))
    with pytest.raises(InvalidSamplingParamsError, match="max_tokens"):
        params(max_tokens=0)  # without echo there would be nothing to return
    assert params(prompt_logprobs=3).prompt_logprobs == 3  # vLLM's extension


def test_chat_fields_map_to_sampling_params() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "logprobs": True,
            "top_logprobs": 3,
        }
    )
    params = chat_sampling_params(request)
    assert params.max_tokens == 7 and params.logprobs == 3
    assert chat_messages(request) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    defaults = chat_sampling_params(
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    )
    assert defaults.max_tokens is None and defaults.logprobs is None  # until max_model_len
    plain_logprobs = chat_sampling_params(
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True}
        )
    )
    assert plain_logprobs.logprobs == 0  # the sampled token's only


def test_bad_chat_fields_name_the_parameter() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(RequestFieldError) as error:
        chat_sampling_params(
            ChatCompletionRequest.model_validate(
                {"messages": messages, "prompt_logprobs": 1, "stream": True}
            )
        )
    assert error.value.param == "prompt_logprobs"
    message = {"role": "user", "content": "x"}
    with pytest.raises(RequestFieldError) as error:
        chat_sampling_params(
            ChatCompletionRequest.model_validate({"messages": [message], "top_logprobs": 2})
        )
    assert error.value.param == "top_logprobs"
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    with pytest.raises(RequestFieldError) as error:
        chat_messages(ChatCompletionRequest.model_validate({"messages": [image]}))
    assert error.value.param == "messages"


def test_serve_without_the_extra_says_what_to_install(tmp_path: Path) -> None:
    # A meta-path finder that refuses FastAPI stands in for "the serve extra is missing".
    code = textwrap.dedent(
        """
        import sys

        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "fastapi":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, Refuse())
        from pagedinfer.cli import main
        sys.exit(main(["serve", sys.argv[1]]))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": ""},
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "pip install '.[serve]' in the pagedinfer checkout" in result.stderr
    assert "fastapi" in result.stderr
    assert "Traceback" not in result.stderr


def test_library_errors_become_openai_errors() -> None:
    from pagedinfer.errors import EngineClosedError, EngineDeadError, StepFailedError
    from pagedinfer.serving.errors import from_exception

    bad = from_exception(InvalidSamplingParamsError("SamplingParams.top_p=2 is invalid: ..."))
    assert (bad.status, bad.param, bad.type) == (400, "top_p", "invalid_request_error")
    vocab = from_exception(InvalidRequestError("SamplingParams.logprobs=9999 exceeds the ..."))
    assert (vocab.status, vocab.param) == (400, "logprobs")
    too_long = from_exception(InvalidRequestError("the prompt has 9 tokens; ... max_model_len=8"))
    assert (too_long.status, too_long.param) == (400, None)
    # 5xx bodies are generic: the exception's text (which may hold paths, reprs) stays out.
    internals = "/secret/path RuntimeError('CUDA error: device-side assert')"
    dead = from_exception(EngineDeadError(internals))
    assert (dead.status, dead.type, dead.code) == (503, "server_error", "engine_unavailable")
    closed = from_exception(EngineClosedError(internals))
    assert (closed.status, closed.type, closed.code) == (503, "server_error", "engine_unavailable")
    failed = from_exception(StepFailedError(internals, (3,)))
    assert (failed.status, failed.type) == (500, "server_error")
    for error in (RuntimeError(internals), ValueError(internals), KeyError(internals)):
        assert from_exception(error).status == 500  # a bug, not the client's mistake
    for converted in (dead, closed, failed, from_exception(ValueError(internals))):
        assert "secret" not in converted.message and "CUDA" not in converted.message
    assert set(bad.body()["error"]) == {"message", "type", "param", "code"}


# ------------------------------------------------------------------ strict schema
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "10"}, "max_tokens"),
        ({"n": "2"}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": True}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"prompt": [True, False]}, "prompt"),
        ({"prompt": [[1, True]]}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"temperature": "0.5"}, "temperature"),
        ({"seed": "7"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop": ["a", 1]}, "stop"),
        ({"logit_bias": {"5": "1"}}, "logit_bias"),
        ({"echo": "true"}, "echo"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ],
)
def test_wrong_json_types_are_refused(fields: dict[str, object], param: str) -> None:
    with pytest.raises(ValidationError) as error:
        CompletionRequest.model_validate({"prompt": "hi", **fields})
    assert error.value.errors()[0]["loc"][0] == param


def test_json_integers_are_accepted_where_numbers_are_expected() -> None:
    request = CompletionRequest.model_validate(
        {"prompt": "hi", "temperature": 1, "top_p": 1, "logit_bias": {"5": 2}}
    )
    params = completion_sampling_params(request)
    assert params.temperature == 1.0 and params.logit_bias == {5: 2.0}
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 1}
    )
    assert chat_sampling_params(chat).presence_penalty == 1.0


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ],
)
@pytest.mark.parametrize("value", [1e39, -1e39, 1e-46, float("inf"), float("nan")])
def test_device_floats_must_be_finite_in_float32(field: str, value: float) -> None:
    with pytest.raises(ValidationError, match="float32") as error:
        CompletionRequest.model_validate({"prompt": "hi", field: value})
    assert error.value.errors()[0]["loc"][0] == field


def test_float32_edges_are_accepted() -> None:
    # The largest float32 and the smallest positive one (subnormal) are representable; 0 too.
    request = CompletionRequest.model_validate(
        {"prompt": "hi", "temperature": 3.4028234663852886e38, "min_p": 0, "top_p": 1.5e-45}
    )
    assert request.temperature == 3.4028234663852886e38 and request.top_p == 1.5e-45


@pytest.mark.parametrize("bias", [100.5, -101, 1000, 1e39, float("nan")])
def test_logit_bias_is_within_openais_range(bias: float) -> None:
    with pytest.raises(ValidationError) as error:
        CompletionRequest.model_validate({"prompt": "hi", "logit_bias": {"5": bias}})
    assert error.value.errors()[0]["loc"][:2] == ("logit_bias", "5")
    for edge in (100, -100, 0.5):
        request = CompletionRequest.model_validate({"prompt": "hi", "logit_bias": {"5": edge}})
        assert completion_sampling_params(request).logit_bias == {5: edge}


# ------------------------------------------------------------------ sizes before work
LIMITS = RequestLimits(max_n=4, max_logprobs=5, max_stop=3, max_stop_str_len=10)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"n": 5}, "n", "max_n=4"),
        ({"n": 10**12}, "n", "max_n=4"),
        ({"prompt": ["a", "b", "c"], "n": 2}, "prompt", "6 sequences"),
        ({"prompt": [[1]] * 5}, "prompt", "5 sequences"),
        ({"logprobs": 6}, "logprobs", r"\[0, 5\]"),
        ({"logprobs": -1}, "logprobs", r"\[0, 5\]"),
        ({"prompt_logprobs": 6}, "prompt_logprobs", r"\[0, 5\]"),
        ({"stop": ["a", "b", "c", "d"]}, "stop", "4 strings.*max_stop=3"),
        ({"stop": "x" * 11}, "stop", "11 characters.*max_stop_str_len=10"),
        ({"stop": ["a", "x" * 11]}, "stop", "11 characters"),
        ({"stop_token_ids": list(range(101))}, "stop_token_ids", "101 entries"),
        ({"logit_bias": {str(i): 1 for i in range(101)}}, "logit_bias", "101 entries"),
    ],
)
def test_sizes_over_the_limits_are_refused(
    fields: dict[str, object], param: str, message: str
) -> None:
    request = CompletionRequest.model_validate({"prompt": "hi", **fields})
    with pytest.raises(RequestFieldError, match=message) as error:
        check_sizes(request, LIMITS, vocab_size=100)
    assert error.value.param == param


def test_sizes_at_the_limits_pass() -> None:
    request = CompletionRequest.model_validate(
        {
            "prompt": ["a", "b"],
            "n": 2,
            "logprobs": 5,
            "prompt_logprobs": 5,
            "stop": ["a", "b", "x" * 10],
            "stop_token_ids": list(range(100)),
            "logit_bias": {str(i): 1 for i in range(100)},
        }
    )
    check_sizes(request, LIMITS, vocab_size=100)
    check_sizes(CompletionRequest(prompt=[1, 2, 3, 4, 5], n=4), LIMITS, vocab_size=100)
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True}
    check_sizes(ChatCompletionRequest.model_validate({**chat, "top_logprobs": 5}), LIMITS, 100)
    with pytest.raises(RequestFieldError) as error:
        check_sizes(ChatCompletionRequest.model_validate({**chat, "top_logprobs": 6}), LIMITS, 100)
    assert error.value.param == "top_logprobs"
    unlimited = RequestLimits(max_logprobs=-1)  # -1: the whole vocabulary
    check_sizes(CompletionRequest(prompt="x", logprobs=100), unlimited, vocab_size=100)
