"""Request bodies to SamplingParams and prompts, without a server."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from pagedinfer import SamplingParams
from pagedinfer.errors import InvalidRequestError, InvalidSamplingParamsError
from pagedinfer.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestFieldError,
    chat_messages,
    chat_sampling_params,
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
            "unknown_field": "ignored",
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
        "suffix": {"suffix": "x"},
        "best_of": {"best_of": 2},
        "logprobs": {"logprobs": 21},
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
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    cases = {
        "tools": {"tools": [tool]},
        "functions": {"functions": [tool["function"]]},
        "tool_choice": {"tool_choice": "required"},
        "response_format": {"response_format": {"type": "json_object"}},
        "top_logprobs": {"top_logprobs": 21, "logprobs": True},
        "prompt_logprobs": {"prompt_logprobs": 1, "stream": True},
    }
    for param, fields in cases.items():
        with pytest.raises(RequestFieldError) as error:
            chat_sampling_params(
                ChatCompletionRequest.model_validate({"messages": messages, **fields})
            )
        assert error.value.param == param
    # Asking for nothing is fine (clients send these by default).
    for fields in ({"tools": [], "tool_choice": "none"}, {"response_format": {"type": "text"}}):
        chat_sampling_params(ChatCompletionRequest.model_validate({"messages": messages, **fields}))
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
    assert "pip install 'pagedinfer[serve]'" in result.stderr
    assert "fastapi" in result.stderr
    assert "Traceback" not in result.stderr


def test_library_errors_become_openai_errors() -> None:
    from pagedinfer.errors import EngineDeadError
    from pagedinfer.serving.errors import from_exception

    bad = from_exception(InvalidSamplingParamsError("SamplingParams.top_p=2 is invalid: ..."))
    assert (bad.status, bad.param, bad.type) == (400, "top_p", "invalid_request_error")
    vocab = from_exception(InvalidRequestError("SamplingParams.logprobs=9999 exceeds the ..."))
    assert (vocab.status, vocab.param) == (400, "logprobs")
    too_long = from_exception(InvalidRequestError("the prompt has 9 tokens; ... max_model_len=8"))
    assert (too_long.status, too_long.param) == (400, None)
    dead = from_exception(EngineDeadError("the engine failed"))
    assert (dead.status, dead.type, dead.code) == (503, "server_error", "engine_unavailable")
    assert from_exception(RuntimeError("boom")).status == 500
    assert set(bad.body()["error"]) == {"message", "type", "param", "code"}
