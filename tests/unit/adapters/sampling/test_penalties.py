"""Penalties on the device against references: transformers' repetition penalty processor, and
an OpenAI-rule presence/frequency reference written out token by token; counts kept
incrementally across steps equal counts rebuilt from the full history."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from pagedinfer.adapters.sampling.logits_processors import LogitsProcessors
from pagedinfer.domain import SamplingParams

CPU = torch.device("cpu")


def after(steps: list[int]) -> Callable[[int], int]:
    """Sample positions for rows whose requests generated ``steps[i]`` tokens (requests added
    without a prompt: ``num_prompt_tokens == 0``; only ``min_tokens`` rows are asked)."""
    return lambda row: steps[row] - 1


def reference(
    logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """vLLM's order: repetition (transformers' processor over prompt + output), then
    frequency and presence over the output, one token id at a time."""
    row = logits.clone().unsqueeze(0)
    history = torch.tensor([prompt + output], dtype=torch.int64)
    if params.repetition_penalty != 1.0 and history.numel():
        row = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(history, row)
    row = row.squeeze(0)
    for token in set(output):
        count = output.count(token)
        row[token] -= params.frequency_penalty * count + params.presence_penalty
    return row


def random_history(rng: random.Random, vocab: int) -> tuple[list[int], list[int]]:
    # Few distinct ids so that prompt and output overlap and tokens repeat.
    ids = rng.sample(range(vocab), 12)
    prompt = [rng.choice(ids) for _ in range(rng.randint(1, 20))]
    output = [rng.choice(ids) for _ in range(rng.randint(0, 20))]
    return prompt, output


@pytest.mark.parametrize(("rows", "vocab"), [(1, 16), (5, 97), (12, 1000)])
def test_penalties_match_the_references(rows: int, vocab: int) -> None:
    rng = random.Random(rows * vocab)
    generator = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=generator) * 4
    processors = LogitsProcessors(vocab, CPU, initial_rows=2)
    expected = []
    for row in range(rows):
        params = SamplingParams(
            repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]),
            frequency_penalty=rng.choice([0.0, 0.5, -1.5]),
            presence_penalty=rng.choice([0.0, 1.0, -0.25]),
        )
        prompt, output = random_history(rng, vocab)
        if processors.add(row, params, prompt, output):
            expected.append(reference(logits[row], prompt, output, params))
        else:
            expected.append(logits[row].clone())
    step = processors.plan(list(range(rows)), after([0] * rows))
    processed = logits.clone()
    if step is not None:
        processors.apply(processed, step)
    torch.testing.assert_close(processed, torch.stack(expected), rtol=1e-6, atol=1e-6)


def test_repetition_penalty_counts_prompt_tokens_and_the_rest_only_output_tokens() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, 2.0]])
    processors = LogitsProcessors(4, CPU)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0)
    processors.add(0, params, prompt_token_ids=[0, 1], output_token_ids=[2, 2])
    step = processors.plan([0], after([2]))
    assert step is not None
    processors.apply(logits, step)
    # token 0: prompt -> 2/2; token 1: prompt, negative -> -2*2; token 2: output twice ->
    # 2/2 - 0.5*2 - 1; token 3: unseen.
    assert logits.tolist() == [[1.0, -4.0, -1.0, 2.0]]


@pytest.mark.parametrize("plain_keys", [(), (100, 101)], ids=["all processed", "plain rows"])
def test_counts_kept_incrementally_equal_counts_from_the_history(
    plain_keys: tuple[int, ...],
) -> None:
    """With ``plain_keys``, requests without penalties share the steps: their rows are left
    alone and their samples are not counted for anyone."""
    vocab, rows, steps = 50, 6, 25
    rng = random.Random(0)
    processors = LogitsProcessors(vocab, CPU, initial_rows=1)  # grows while requests arrive
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    histories: dict[int, tuple[list[int], list[int]]] = {}
    keys = [10, 3, 7, 42, 5, 8]
    for key in keys[:rows]:
        prompt, output = random_history(rng, vocab)
        processors.add(key, params, prompt, output)
        histories[key] = (prompt, output)
    generator = torch.Generator().manual_seed(1)
    for step_index in range(steps):
        # A different subset of the requests, in a different order, each step.
        batch = rng.sample(keys, rng.randint(1, rows)) + list(plain_keys)
        rng.shuffle(batch)
        logits = torch.randn(len(batch), vocab, generator=generator) * 3
        step = processors.plan(batch, after([len(histories.get(k, ((), []))[1]) for k in batch]))
        assert step is not None
        processed = logits.clone()
        processors.apply(processed, step)
        for i, key in enumerate(batch):
            if key in plain_keys:
                assert torch.equal(processed[i], logits[i])
                continue
            prompt, output = histories[key]
            torch.testing.assert_close(
                processed[i], reference(logits[i], prompt, output, params), msg=f"step {step_index}"
            )
        sampled = torch.randint(0, vocab, (len(batch),), generator=generator)
        processors.record(step, sampled)
        for key, token in zip(batch, sampled.tolist(), strict=True):
            if key not in plain_keys:
                histories[key][1].append(token)


def test_masked_logits_stay_masked_and_nothing_becomes_nan() -> None:
    logits = torch.tensor([[-math.inf, 3.0, -1.0, 0.0]])
    processors = LogitsProcessors(4, CPU)
    params = SamplingParams(repetition_penalty=3.0, frequency_penalty=-2.0, presence_penalty=-2.0)
    processors.add(0, params, prompt_token_ids=[0, 3], output_token_ids=[0, 0, 1])
    step = processors.plan([0], after([3]))
    assert step is not None
    processors.apply(logits, step)
    assert logits[0, 0] == -math.inf
    assert not logits.isnan().any()
    assert logits[0, 3] == 0.0  # 0 stays 0 under the repetition penalty
