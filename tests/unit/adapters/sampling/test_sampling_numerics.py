"""Sampling numerics (#11.6): tiny temperatures are greedy, never NaN, host and device agree.

Regression: ``temperature=1e-40`` sampled token 0 every time (logits / 1e-40 overflowed to
inf, the softmax to NaN), ``1e-50`` silently sampled at temperature 1 (float32(1e-50) == 0 on
the device while the host flags said "not greedy").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedinfer.adapters.sampling.batch import SamplingBatch
from pagedinfer.adapters.sampling.sampler import Sampler
from pagedinfer.domain import SamplingParams
from pagedinfer.domain.sampling import GREEDY_TEMPERATURE_EPSILON

from ..runner_helpers import generate, make_runner, random_prompts

CPU = torch.device("cpu")
TINY = [1e-40, 1e-50, 5e-324, 1e-300, 9.99e-6, 0.0]


def rows_with(temperatures: list[float]) -> SamplingBatch:
    params = [SamplingParams(temperature=t) for t in temperatures]
    return SamplingBatch.from_params(params, CPU)


@pytest.mark.parametrize("temperature", TINY)
def test_a_tiny_temperature_is_argmax_alone(temperature: float) -> None:
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(0)) * 30
    sampling = rows_with([temperature] * 8)
    assert sampling.all_greedy
    assert torch.equal(Sampler(CPU)(logits, sampling), logits.argmax(dim=-1))


def test_tiny_temperatures_are_argmax_in_a_batch_that_samples() -> None:
    temperatures = [*TINY, 1.0, GREEDY_TEMPERATURE_EPSILON, 2.0]
    logits = torch.randn(len(temperatures), 500, generator=torch.Generator().manual_seed(1)) * 30
    sampling = rows_with(temperatures)
    assert sampling.any_greedy and not sampling.all_greedy
    # Host and device agree: the rows the host calls greedy are temperature 0 on the device.
    assert sampling.temperatures is not None
    device_greedy = (sampling.temperatures < GREEDY_TEMPERATURE_EPSILON).tolist()
    assert device_greedy == [SamplingParams(temperature=t).is_greedy for t in temperatures]
    for _ in range(20):
        tokens = Sampler(CPU)(logits, sampling)
        assert torch.equal(tokens[: len(TINY)], logits[: len(TINY)].argmax(dim=-1))


def test_the_device_mask_alone_never_divides_by_a_tiny_temperature() -> None:
    # Flags that say "some rows sample, some are greedy" but temperatures that the host did not
    # normalise: the device-side mask must still treat 1e-40 as greedy (no inf, no NaN).
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(2)) * 30
    sampling = SamplingBatch(
        all_greedy=False,
        any_greedy=True,
        temperatures=torch.tensor([1e-40, 1.0, 1e-6], dtype=torch.float32),
        top_ks=torch.zeros(3, dtype=torch.int64),
        top_ps=torch.ones(3),
    )
    tokens = Sampler(CPU)(logits, sampling)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_small_temperatures_above_the_epsilon_stay_finite() -> None:
    # 1e-5 is the smallest sampled temperature: logits / 1e-5 must not overflow float32.
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(3)) * 50
    for temperature in (GREEDY_TEMPERATURE_EPSILON, 2e-5, 1e-3):
        sampling = rows_with([temperature] * 64)
        assert not sampling.any_greedy
        tokens = Sampler(CPU)(logits, sampling)
        # Such a cold distribution is argmax unless two logits are within ~1e-4 of each other.
        assert torch.equal(tokens, logits.argmax(dim=-1))


def test_tiny_temperatures_generate_the_greedy_tokens(make_checkpoint: Callable[..., Path]) -> None:
    runner = make_runner(make_checkpoint("tiny"))
    try:
        prompts = random_prompts(11, 4, (3, 20))
        greedy, _ = generate(runner, prompts, SamplingParams(temperature=0.0, max_tokens=6))
        for temperature in (1e-40, 1e-50):
            mixed = [SamplingParams(temperature=temperature, max_tokens=6)] * 4
            mixed[1] = SamplingParams(temperature=1.0, max_tokens=6)  # the batch samples too
            tokens, _ = generate(runner, prompts, mixed)
            assert [tokens[i] for i in (0, 2, 3)] == [greedy[i] for i in (0, 2, 3)]
    finally:
        runner.close()


def test_masks_bias_and_penalties_at_their_bounds_stay_finite_in_a_mixed_batch() -> None:
    """Greedy and sampled rows together, each with ``-inf`` masks (allowed ids, min_p,
    top-k / top-p), biases of +-100, penalties at their bounds and temperatures from the
    epsilon to 100: no NaN reaches the race, and every row keeps its constraints."""
    from pagedinfer.adapters.sampling.logits_processors import LogitsProcessors
    from pagedinfer.adapters.sampling.sampler import filtered_logits

    vocab = 50
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=[3, 4], top_k=2, min_p=0.5),
        SamplingParams(temperature=1e-5, allowed_token_ids=[3, 4, 9], logit_bias={4: 100.0}),
        SamplingParams(temperature=100.0, top_p=0.3, logit_bias={1: -100.0, 2: 100.0}),
        SamplingParams(temperature=1.0, allowed_token_ids=[7], top_k=3, top_p=0.1, min_p=0.9),
        SamplingParams(
            temperature=0.7,
            repetition_penalty=2.0,
            presence_penalty=2.0,
            frequency_penalty=-2.0,
            min_p=1e-4,
            top_k=vocab,
        ),
        SamplingParams(temperature=1.0, allowed_token_ids=[5, 6], min_tokens=2, stop_token_ids=[5]),
    ]
    processors = LogitsProcessors(vocab, CPU, eos_token_ids=[0])
    for key, p in enumerate(params):
        processors.add(key, p, prompt_token_ids=[1, 2, 3], output_token_ids=[3, 3])
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(4)) * 20
    processing = processors.plan(list(range(len(params))), lambda _: 3)
    batch = SamplingBatch.from_params(params, CPU, vocab_size=vocab)
    filtered = filtered_logits(logits.clone(), batch, processors, processing)
    assert not filtered.isnan().any() and torch.isfinite(filtered).any(dim=-1).all()
    for seed in range(10):
        tokens = Sampler(CPU, seed=seed)(logits.clone(), batch, processors, processing).tolist()
        assert tokens[0] in (3, 4) and tokens[1] == 4 and tokens[2] != 1 and tokens[3] == 7
        assert tokens[5] == 6  # 5 is held back by min_tokens
