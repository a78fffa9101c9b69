"""A stop that completes on the last token the limits allow ends the request with "stop".

The token that reaches ``max_tokens`` (or ``max_model_len``) may also be a stop token id, or
complete a stop string: the request then reports ``finish_reason="stop"`` and the stop as
its ``stop_reason``, not ``"length"`` (as in vLLM). The scheduler decides for stop token ids
(its finish rule checks stops before limits); for stop strings the engine does, after the
scheduler has already finished the sequence by length in the same step (``Engine._update``).

Real engine, tiny random checkpoint, greedy: the stops are picked from what a free greedy run
of the same prompt produces, at a token ``K`` that is the first to contain them; the limits
are then set so that ``K`` is the last token allowed. Each case is checked against the same
request with a limit one token shorter, which must end by length just before the stop (so the
stop is exactly on the boundary, not before it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pagedinfer import CompletionOutput, Engine, SamplingParams

PROMPT = "The quick brown fox"
NUM_FREE = 12  # tokens of the free greedy run the stops are picked from


@dataclass(frozen=True)
class FreeRun:
    prompt_token_ids: list[int]
    token_ids: list[int]
    texts: list[str]  # texts[i]: the completion's text after i + 1 tokens (as streamed)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", with_tokenizer=True)


@pytest.fixture(scope="module")
def free(checkpoint: Path) -> FreeRun:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_FREE, ignore_eos=True)
    with Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=64) as engine:
        deltas = list(engine.stream(PROMPT, params))
        (whole,) = engine.generate(PROMPT, params, use_tqdm=False)
    tokens = [t for delta in deltas for t in delta.outputs[0].token_ids]
    assert tokens == whole.outputs[0].token_ids and len(tokens) == NUM_FREE
    assert len(deltas) == NUM_FREE  # one token per step: texts[i] is after token i + 1
    texts = []
    for delta in deltas:
        texts.append((texts[-1] if texts else "") + delta.outputs[0].text)
    assert texts[-1] == whole.outputs[0].text
    return FreeRun(whole.prompt_token_ids, tokens, texts)


def stop_token(free: FreeRun) -> tuple[int, int]:
    """(K, token id): the K-th token (K >= 2) is that id's first occurrence."""
    tokens = free.token_ids
    for k in range(2, len(tokens) + 1):
        if tokens[k - 1] not in tokens[: k - 1]:
            return k, tokens[k - 1]
    raise AssertionError(f"no token of the free run occurs first after the first: {tokens}")


def stop_string(free: FreeRun) -> tuple[int, str]:
    """(K, stop string): the string spans tokens K - 1 and K and first occurs with token K."""
    texts = free.texts
    for k in range(3, len(texts) + 1):
        before, after = texts[k - 2], texts[k - 1]
        if len(after) == len(before) or not before:
            continue
        stop = before[-1] + after[len(before)]
        if "\ufffd" not in stop and not stop.isspace() and stop not in before:
            return k, stop
    raise AssertionError(f"no stop string spans two tokens of the free run: {texts}")


@dataclass(frozen=True)
class Limit:
    """Engine and request settings under which exactly ``allowed`` tokens may be generated."""

    by_max_model_len: bool

    def engine(self, checkpoint: Path, prompt_len: int, allowed: int) -> Engine:
        max_model_len = prompt_len + allowed if self.by_max_model_len else 64
        return Engine(checkpoint, device="cpu", kv_block_size=16, max_model_len=max_model_len)

    def max_tokens(self, allowed: int) -> int | None:
        return None if self.by_max_model_len else allowed


LIMITS = [
    pytest.param(Limit(by_max_model_len=False), id="max_tokens"),
    pytest.param(Limit(by_max_model_len=True), id="max_model_len"),
]


def run(
    checkpoint: Path, free: FreeRun, limit: Limit, allowed: int, *, stream: bool, **stops: Any
) -> CompletionOutput:
    params = SamplingParams(
        temperature=0.0, max_tokens=limit.max_tokens(allowed), ignore_eos=True, **stops
    )
    with limit.engine(checkpoint, len(free.prompt_token_ids), allowed) as engine:
        if not stream:
            (output,) = engine.generate(PROMPT, params, use_tqdm=False)
            return output.outputs[0]
        deltas = list(engine.stream(PROMPT, params))
    last = deltas[-1].outputs[0]
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    return CompletionOutput(
        index=last.index,
        text="".join(d.outputs[0].text for d in deltas),
        token_ids=[t for d in deltas for t in d.outputs[0].token_ids],
        cumulative_logprob=None,
        logprobs=None,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
    )


@pytest.mark.parametrize("limit", LIMITS)
def test_a_stop_token_id_on_the_last_allowed_token(
    checkpoint: Path, free: FreeRun, limit: Limit
) -> None:
    k, stop = stop_token(free)
    output = run(checkpoint, free, limit, k, stream=False, stop_token_ids=[stop])
    assert output.token_ids == free.token_ids[:k]
    assert (output.finish_reason, output.stop_reason) == ("stop", stop)
    shorter = run(checkpoint, free, limit, k - 1, stream=False, stop_token_ids=[stop])
    assert shorter.token_ids == free.token_ids[: k - 1]
    assert (shorter.finish_reason, shorter.stop_reason) == ("length", None)


@pytest.mark.parametrize("stream", [False, True], ids=["generate", "stream"])
@pytest.mark.parametrize("limit", LIMITS)
def test_a_stop_string_completed_by_the_last_allowed_token(
    checkpoint: Path, free: FreeRun, limit: Limit, stream: bool
) -> None:
    k, stop = stop_string(free)
    text = free.texts[k - 1]
    output = run(checkpoint, free, limit, k, stream=stream, stop=[stop])
    assert output.token_ids == free.token_ids[:k]
    assert output.text == text[: text.index(stop)]
    assert (output.finish_reason, output.stop_reason) == ("stop", stop)
    kept = run(
        checkpoint, free, limit, k, stream=stream, stop=[stop], include_stop_str_in_output=True
    )
    assert kept.text == text[: text.index(stop) + len(stop)]
    assert (kept.finish_reason, kept.stop_reason) == ("stop", stop)
    shorter = run(checkpoint, free, limit, k - 1, stream=stream, stop=[stop])
    assert shorter.token_ids == free.token_ids[: k - 1]
    assert shorter.text == free.texts[k - 2]
    assert (shorter.finish_reason, shorter.stop_reason) == ("length", None)
