"""Request limits (issue 21, item 2): every size a request asks for is checked before any work
that grows with it, in time independent of its value.

Before, ``n=300000`` was refused only after 300,000 sequences were built (14-17 s with the
engine's lock held, +350 MB), logprobs had no limit below the vocabulary, and a prompt's ids
were all checked one by one before its length.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedinfer import Engine, SamplingParams
from pagedinfer.domain.limits import RequestLimits
from pagedinfer.engine.prompts import TokenizedPrompt
from pagedinfer.errors import ConfigurationError, InvalidRequestError

VOCAB = 512
OPTIONS = {"device": "cpu", "kv_block_size": 16, "max_model_len": 128, "num_kv_blocks": 32}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[Engine]:
    with Engine(checkpoint, **OPTIONS) as engine:
        yield engine


def _refused_quickly(call: Callable[[], object], match: str) -> None:
    """``call()`` raises InvalidRequestError matching ``match`` within 0.1 s and without
    allocating more than 1 MB on the way."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(InvalidRequestError, match=match):
            call()
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 0.1, f"refused after {elapsed:.3f} s"
    assert peak < 1 << 20, f"{peak} bytes allocated before the refusal"


def test_a_huge_n_is_refused_at_once(engine: Engine) -> None:
    for n in (10**5, 10**8):  # in one test: code that builds n sequences fails at the first
        p = SamplingParams(n=n)
        _refused_quickly(lambda p=p: engine.generate([[1, 2, 3]], p, use_tqdm=False), f"n={n}")
        _refused_quickly(lambda p=p: engine.add_request([1, 2, 3], p), f"n={n}")
        _refused_quickly(lambda p=p: engine.stream([1, 2, 3], p), f"n={n}")
    assert not engine.has_unfinished_requests()


def test_n_is_bounded_by_max_n(checkpoint: Path) -> None:
    with Engine(checkpoint, max_n=3, **OPTIONS) as engine:
        assert engine.request_limits.max_n == 3
        (output,) = engine.generate([[1, 2]], SamplingParams(n=3, max_tokens=2), use_tqdm=False)
        assert len(output.outputs) == 3
        with pytest.raises(InvalidRequestError, match=r"n=4 exceeds max_n=3.*--max-n"):
            engine.check_sampling_params(SamplingParams(n=4))


def test_logprobs_are_bounded_by_max_logprobs(engine: Engine, checkpoint: Path) -> None:
    assert engine.request_limits.max_logprobs == 20  # vLLM's default
    engine.check_sampling_params(SamplingParams(logprobs=20, prompt_logprobs=20))
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(
            InvalidRequestError, match=rf"{field}=21 exceeds max_logprobs=20.*--max-logprobs"
        ):
            engine.check_sampling_params(SamplingParams(**{field: 21}))
    with Engine(checkpoint, max_logprobs=-1, **OPTIONS) as whole:  # vLLM: -1 = the vocabulary
        assert whole.request_limits.max_logprobs == VOCAB
        params = SamplingParams(logprobs=VOCAB, max_tokens=1)
        (output,) = whole.generate([[1, 2]], params, use_tqdm=False)
        assert len(output.outputs[0].logprobs[0]) == VOCAB  # type: ignore[index]


def test_stop_strings_are_bounded(checkpoint: Path) -> None:
    with Engine(checkpoint, max_stop=2, max_stop_str_len=5, **OPTIONS) as engine:
        engine.check_sampling_params(SamplingParams(stop=["a", "12345"]))
        with pytest.raises(InvalidRequestError, match=r"<3 strings> exceeds max_stop=2"):
            engine.check_sampling_params(SamplingParams(stop=["a", "b", "c"]))
        with pytest.raises(InvalidRequestError, match=r"6 characters.*max_stop_str_len=5"):
            engine.check_sampling_params(SamplingParams(stop=["123456"]))


@pytest.mark.parametrize(
    "field", ["stop_token_ids", "allowed_token_ids", "logit_bias"], ids=lambda f: f
)
def test_token_id_lists_are_bounded_by_the_vocabulary(engine: Engine, field: str) -> None:
    ids = [1] * (VOCAB + 1) if field != "logit_bias" else None
    value: object = ids if ids is not None else {i: 1.0 for i in range(VOCAB + 1)}
    params = SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=rf"{field} has {VOCAB + 1} entries"):
        engine.check_sampling_params(params)


def test_a_prompt_is_measured_before_its_ids_are_checked(engine: Engine) -> None:
    """A million ids, all out of range: refused for its length, without looking at them."""
    huge = [10**9] * 1_000_000
    for call in (engine.add_request, engine.tokenize):
        started = time.perf_counter()
        with pytest.raises(InvalidRequestError, match=r"1000000 tokens.*max_model_len=128"):
            call(huge)
        assert time.perf_counter() - started < 0.1


def test_tokenize_returns_a_validated_prompt_that_is_not_tokenized_again(engine: Engine) -> None:
    prompt = engine.tokenize("Hello, world!")
    assert isinstance(prompt, TokenizedPrompt) and prompt.text == "Hello, world!"
    assert list(prompt.token_ids) == engine.tokenizer.encode("Hello, world!")
    assert engine.tokenize(prompt) is prompt
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    by_text, by_prompt = engine.generate(["Hello, world!", prompt], greedy, use_tqdm=False)
    assert by_prompt.prompt == "Hello, world!"
    assert by_prompt.prompt_token_ids == by_text.prompt_token_ids
    assert by_prompt.outputs[0].token_ids == by_text.outputs[0].token_ids
    # One made by hand is checked (not trusted): its ids must be in the vocabulary.
    with pytest.raises(InvalidRequestError, match="out of vocabulary"):
        engine.add_request(TokenizedPrompt(None, (1, VOCAB)))
    chat = engine.tokenize_chat(
        [{"role": "user", "content": "Hi"}], chat_template="{{ messages[0]['content'] }}!"
    )
    assert chat.text == "Hi!" and list(chat.token_ids) == engine.tokenizer.encode(
        "Hi!", add_special_tokens=False
    )
    assert not engine.has_unfinished_requests()


def test_the_limits_are_checked_when_the_engine_is_built(checkpoint: Path) -> None:
    for bad in ({"max_n": 0}, {"max_logprobs": -2}, {"max_stop": 0}, {"max_stop_str_len": 0}):
        with pytest.raises(ConfigurationError, match=next(iter(bad))):
            Engine(checkpoint, **bad, **OPTIONS)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="max_consecutive_failed_steps"):
        Engine(checkpoint, max_consecutive_failed_steps=0, **OPTIONS)
    assert RequestLimits() == RequestLimits(max_n=128, max_logprobs=20)


def test_the_command_line_sets_the_limits() -> None:
    from pagedinfer.cli import _build_parser, _engine_kwargs

    flags = ["--max-n", "4", "--max-logprobs", "-1", "--max-stop", "8"]
    flags += ["--max-stop-str-len", "16", "--max-consecutive-failed-steps", "5"]
    args = _build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", *flags])
    kwargs = _engine_kwargs(args)
    assert (kwargs["max_n"], kwargs["max_logprobs"], kwargs["max_stop"]) == (4, -1, 8)
    assert (kwargs["max_stop_str_len"], kwargs["max_consecutive_failed_steps"]) == (16, 5)
    defaults = _engine_kwargs(_build_parser().parse_args(["generate", "--model", "m"]))
    assert (defaults["max_n"], defaults["max_logprobs"]) == (128, 20)
