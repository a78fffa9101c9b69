"""vLLM's SamplingParams fields at the engine: max_tokens=None, top_k=-1, tiny temperatures."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedinfer import Engine, SamplingParams
from pagedinfer.errors import InvalidRequestError

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def engine(make_checkpoint: Callable[..., Path]) -> Iterator[Engine]:
    with Engine(
        make_checkpoint("tiny"), device="cpu", kv_block_size=16, max_model_len=32
    ) as engine:
        yield engine


def test_max_tokens_none_generates_up_to_max_model_len(engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.prompt_token_ids) + len(o.token_ids) for o in outputs] == [32, 32]
    assert all(o.finish_reason == "length" for o in outputs)


def test_top_k_minus_one_is_top_k_off(engine: Engine) -> None:
    off = engine.generate(PROMPTS, SamplingParams(top_k=0, seed=3, max_tokens=8), use_tqdm=False)
    minus_one = engine.generate(
        PROMPTS, SamplingParams(top_k=-1, seed=3, max_tokens=8), use_tqdm=False
    )
    assert [o.token_ids for o in off] == [o.token_ids for o in minus_one]


def test_tiny_temperatures_are_greedy(engine: Engine) -> None:
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0), use_tqdm=False)
    for temperature in (1e-40, 1e-50, 9e-6):
        tiny = engine.generate(PROMPTS, SamplingParams(temperature=temperature), use_tqdm=False)
        assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy], temperature


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 2},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 1.1},
        {"min_p": 0.1},
        {"min_tokens": 2},
        {"logprobs": 1},
        {"prompt_logprobs": 0},
        {"logit_bias": {1: 2.0}},
        {"allowed_token_ids": [1, 2]},
        {"include_stop_str_in_output": True},
        {"skip_special_tokens": False},
    ],
)
def test_fields_not_served_yet_are_refused_not_ignored(
    engine: Engine, kwargs: dict[str, object]
) -> None:
    (name,) = kwargs
    with pytest.raises(InvalidRequestError, match=f"SamplingParams.{name}"):
        engine.add_request([1, 2], SamplingParams(**kwargs))  # type: ignore[arg-type]
    assert not engine.has_unfinished_requests()
