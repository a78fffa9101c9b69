"""The sampler never returns a token a mask forbids: a row without a finite allowed logit
(NaN logits, every token masked) gets NO_TOKEN, whatever the sampling mode."""

from __future__ import annotations

import math

import pytest
import torch

from pagedinfer.adapters.sampling.batch import SamplingBatch
from pagedinfer.adapters.sampling.failed_rows import NO_LOGITS_REASON, failed_samples
from pagedinfer.adapters.sampling.logits_processors import LogitsProcessors
from pagedinfer.adapters.sampling.sampler import NO_TOKEN, Sampler
from pagedinfer.domain import SamplingParams

CPU = torch.device("cpu")
VOCAB = 8
ALLOWED = [5, 6, 7]


def sampling(rows: int, temperature: float) -> SamplingBatch:
    greedy = temperature == 0.0
    return SamplingBatch(
        all_greedy=greedy,
        any_greedy=greedy,
        temperatures=torch.full((rows,), temperature),
        top_ks=torch.zeros(rows, dtype=torch.int64),
        top_ps=torch.ones(rows),
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_rows_with_allowed_token_ids_get_no_token(temperature: float) -> None:
    processors = LogitsProcessors(VOCAB, CPU)
    processors.add(0, SamplingParams(allowed_token_ids=ALLOWED))
    processors.add(1, SamplingParams())
    step = processors.plan([0, 1, 1], lambda row: 0)
    logits = torch.randn(3, VOCAB)
    logits[0] = math.nan  # a broken model: every logit NaN
    logits[1, 3] = math.nan  # one NaN in an unconstrained row
    assert step is not None
    tokens = Sampler(CPU)(logits, sampling(3, temperature), processors, step).tolist()
    assert tokens[0] == NO_TOKEN
    assert tokens[2] != NO_TOKEN and 0 <= tokens[2] < VOCAB
    assert tokens[1] in (NO_TOKEN, *[t for t in range(VOCAB) if t != 3])


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_fully_masked_row_gets_no_token_and_others_are_untouched(temperature: float) -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    expected = logits.argmax(dim=-1)
    logits[1] = -math.inf
    tokens = Sampler(CPU)(logits, sampling(3, temperature))
    assert tokens[1].item() == NO_TOKEN
    if temperature == 0.0:
        assert tokens[0] == expected[0] and tokens[2] == expected[2]
    assert all(0 <= t < VOCAB for t in tokens[[0, 2]].tolist())


def test_failed_samples_are_reported_with_a_placeholder_token() -> None:
    sampled = [4, NO_TOKEN, 2, NO_TOKEN]
    failed = failed_samples(sampled, {3: "grammar says no", 2: "dead end"})
    assert failed == {1: NO_LOGITS_REASON, 2: "dead end", 3: "grammar says no"}
    assert sampled == [4, 0, 2, 0]
    assert failed_samples([1, 2], None) is None
    assert failed_samples([1, 2], {}) is None
