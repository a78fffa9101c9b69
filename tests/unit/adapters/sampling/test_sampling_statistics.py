"""Sampled tokens of a real Engine against transformers' distribution: chi-square tests.

An independent reference for sampled output (issue 30): a tiny random checkpoint with a
16-token vocabulary (so the next-token distribution is spread out: probabilities from about
0.01 to 0.25), float32 on the CPU with the torch backend. For each setting the engine draws
``DRAWS`` first tokens of one prompt (requests of ``N`` completions with distinct seeds, all
in one ``generate`` call), and Pearson's chi-square compares their counts with the
distribution written out in ``sampling_reference.py`` from transformers' logits: temperature,
``min_p``, top-k, top-p, their combination, ``logit_bias``, ``allowed_token_ids`` and the
repetition penalty on prompt tokens; and, for the second token given the first, presence,
frequency and repetition penalties on the completion.

Seeded draws make every run identical. Each setting must pass at ``P_VALUE`` (a correct
sampler passes with margin: the p-values of this file are mostly above 0.05) and, so that the
test can fail, the same counts must reject the distribution the setting changes (the
temperature-1 softmax of the unprocessed logits) at that level. No draw may fall outside the
reference's kept set. The parameters keep every ``min_p`` and ``top_p`` boundary at least
``MARGIN`` away, so float32 differences between the engine and transformers cannot decide a
token's fate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_reference import hf_model
from pagedinfer import Engine, SamplingParams

from .sampling_reference import (
    chi_square,
    chi_square_p_value,
    near_a_boundary,
    processed_logits,
    sampling_distribution,
)

VOCAB = 16
PROMPT = [5, 9, 2, 7]
N = 100  # completions per request (n)
REQUESTS = 20
DRAWS = N * REQUESTS
SEED = 20_240_601
P_VALUE = 1e-4
MARGIN = 1e-3


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[Engine]:
    with Engine(
        checkpoint,
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        kv_block_size=16,
        num_kv_blocks=1200,
        max_num_seqs=512,
        max_model_len=32,
    ) as engine:
        yield engine


@lru_cache(maxsize=64)
def _hf_logits(path: str, tokens: tuple[int, ...]) -> np.ndarray:
    with torch.inference_mode():
        return hf_model(path)(torch.tensor([tokens])).logits[0, -1].double().numpy()


def hf_logits(checkpoint: Path, tokens: list[int]) -> np.ndarray:
    """transformers' next-token logits after ``tokens`` (float64 ``[vocab]``)."""
    return _hf_logits(str(checkpoint), tuple(tokens))


def draw(engine: Engine, params: SamplingParams, max_tokens: int = 1) -> list[list[int]]:
    """``DRAWS`` completions of PROMPT: REQUESTS requests of N completions, with seeds
    SEED + i for completion i (vLLM's rule for n: request j's seed is SEED + N * j)."""
    requests = [
        replace(params, n=N, seed=SEED + N * j, max_tokens=max_tokens, ignore_eos=True)
        for j in range(REQUESTS)
    ]
    outputs = engine.generate([PROMPT] * REQUESTS, requests, use_tqdm=False)
    return [list(c.token_ids) for output in outputs for c in output.outputs]


def check(counts: np.ndarray, probs: np.ndarray, changed_from: np.ndarray) -> None:
    """Counts follow ``probs`` and reject ``changed_from`` (the distribution without the
    setting), each at P_VALUE; nothing is drawn where ``probs`` is 0."""
    total = counts.sum()
    assert not counts[probs == 0].any(), (counts.tolist(), probs.round(4).tolist())
    statistic, dof = chi_square(counts, total * probs)
    p_value = chi_square_p_value(statistic, dof)
    assert p_value > P_VALUE, (p_value, counts.tolist(), (total * probs).round(1).tolist())
    if np.any(counts[changed_from == 0]):
        return  # drawn where the unchanged distribution has nothing: rejected outright
    statistic, dof = chi_square(counts, total * changed_from)
    assert chi_square_p_value(statistic, dof) < P_VALUE, "the setting changes too little"


def softmax(z: np.ndarray) -> np.ndarray:
    p = np.exp(z - z.max())
    return p / p.sum()


FIRST_TOKEN_SETTINGS = {
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.5": SamplingParams(temperature=0.5),
    "temperature 2": SamplingParams(temperature=2.0),
    "top_k 4": SamplingParams(temperature=1.0, top_k=4),
    "top_p 0.4": SamplingParams(temperature=1.0, top_p=0.4),
    "min_p 0.2": SamplingParams(temperature=1.0, min_p=0.2),
    "combined": SamplingParams(temperature=0.7, min_p=0.05, top_k=8, top_p=0.9),
    "logit_bias": SamplingParams(temperature=1.0, logit_bias={0: 1.5, 7: -2.0, 12: 0.7}),
    "allowed_token_ids": SamplingParams(temperature=1.2, allowed_token_ids=[1, 3, 7, 10, 15]),
    "repetition_penalty": SamplingParams(temperature=1.0, repetition_penalty=1.8),
}


@pytest.mark.parametrize("name", list(FIRST_TOKEN_SETTINGS))
def test_first_tokens_follow_the_reference_distribution(
    engine: Engine, checkpoint: Path, name: str
) -> None:
    params = FIRST_TOKEN_SETTINGS[name]
    logits = hf_logits(checkpoint, PROMPT)
    z = processed_logits(logits, params, PROMPT)
    assert not near_a_boundary(z, params, MARGIN), "choose parameters away from a boundary"
    probs = sampling_distribution(logits, params, PROMPT)
    tokens = [completion[0] for completion in draw(engine, params)]
    counts = np.bincount(tokens, minlength=VOCAB)
    # What the setting changes: the plain softmax (for temperature 1, the uniform draw).
    baseline = softmax(logits) if name != "temperature 1" else np.full(VOCAB, 1 / VOCAB)
    check(counts, probs, changed_from=baseline)


def test_second_tokens_follow_the_penalised_distribution(engine: Engine, checkpoint: Path) -> None:
    """Presence, frequency and repetition penalties act on the completion: the second token
    given the first is drawn from the logits after PROMPT + [first] with the first token
    penalised. One chi-square over the groups of equal first tokens, and one on how often
    the first token repeats (where the three penalties act: the test that separates, say,
    a missing frequency penalty from the presence penalty alone)."""
    params = SamplingParams(
        temperature=1.0, presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3
    )
    completions = draw(engine, params, max_tokens=2)
    statistic = unchanged_statistic = 0.0
    dof = unchanged_dof = 0
    repeats = expected_repeats = repeat_variance = 0.0
    for first in sorted({c[0] for c in completions}):
        seconds = [c[1] for c in completions if c[0] == first]
        logits = hf_logits(checkpoint, [*PROMPT, first])
        probs = sampling_distribution(logits, params, PROMPT, [first])
        counts = np.bincount(seconds, minlength=VOCAB)
        assert not counts[probs == 0].any()
        group_statistic, group_dof = chi_square(counts, len(seconds) * probs)
        statistic, dof = statistic + group_statistic, dof + group_dof
        group_statistic, group_dof = chi_square(counts, len(seconds) * softmax(logits))
        unchanged_statistic += group_statistic
        unchanged_dof += group_dof
        repeats += counts[first]
        expected_repeats += len(seconds) * probs[first]
        repeat_variance += len(seconds) * probs[first] * (1 - probs[first])
    assert chi_square_p_value(statistic, dof) > P_VALUE, (statistic, dof)
    assert chi_square_p_value(unchanged_statistic, unchanged_dof) < P_VALUE
    # The number of repeats is a sum of independent Bernoulli draws: normal, one dof.
    repeat_statistic = (repeats - expected_repeats) ** 2 / repeat_variance
    assert chi_square_p_value(repeat_statistic, 1) > P_VALUE, (repeats, expected_repeats)
