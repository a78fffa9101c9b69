"""Sampler: exact greedy, seeded reproducibility, top-k / top-p support, distribution."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedinfer.adapters.sampling.batch import NO_SEED, SamplingBatch
from pagedinfer.adapters.sampling.logits_processors import LogitsProcessors, ProcessingStep
from pagedinfer.adapters.sampling.sampler import Sampler, filtered_logits, uses_fused_race
from pagedinfer.domain import SamplingParams
from pagedinfer.domain.sampling import GREEDY_TEMPERATURE_EPSILON

CPU = torch.device("cpu")


def batch(
    n: int,
    *,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    top_p: float | list[float] = 1.0,
    seeds: list[int | None] | None = None,
    steps: list[int] | None = None,
) -> SamplingBatch:
    temperatures = temperature if isinstance(temperature, list) else [temperature] * n
    top_ks = top_k if isinstance(top_k, list) else [top_k] * n
    top_ps = top_p if isinstance(top_p, list) else [top_p] * n
    row_seeds = seeds if seeds is not None else [None] * n
    sampled = [i for i in range(n) if temperatures[i] > 0]
    sampled_ks = [top_ks[i] for i in sampled]
    any_seeded = any(row_seeds[i] is not None for i in sampled)
    return SamplingBatch(
        all_greedy=not sampled,
        any_greedy=len(sampled) < n,
        any_top_k=any(k > 0 for k in sampled_ks),
        any_top_p=any(top_ps[i] < 1.0 for i in sampled),
        any_seeded=any_seeded,
        # As the table computes it: the largest k of a sampled row with top-k on (the
        # filter caps it at the vocabulary).
        max_top_k=max(sampled_ks, default=0),
        temperatures=torch.tensor(temperatures, dtype=torch.float32),
        top_ks=torch.tensor(top_ks, dtype=torch.int64),
        top_ps=torch.tensor(top_ps, dtype=torch.float32),
        seeds=torch.tensor([NO_SEED if s is None else s for s in row_seeds]),
        sample_steps=torch.tensor(steps if steps is not None else [0] * n) if any_seeded else None,
    )


def logits_for(probs: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).contiguous()


def frequencies(tokens: torch.Tensor, vocab: int) -> list[float]:
    counts = torch.bincount(tokens, minlength=vocab).float()
    return (counts / counts.sum()).tolist()


def test_greedy_is_exactly_argmax() -> None:
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    tokens = Sampler(CPU)(logits, batch(64, temperature=0.0))
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1))
    temperatures = [0.0, 1.0, 0.0, 2.0, 0.0, 0.5, 1.0, 0.0]
    tokens = Sampler(CPU)(logits, batch(8, temperature=temperatures, top_k=3, top_p=0.5))
    for row, temperature in enumerate(temperatures):
        if temperature == 0.0:
            assert tokens[row] == logits[row].argmax()


def test_bfloat16_logits_are_sampled_in_float32() -> None:
    logits = torch.randn(4, 50).to(torch.bfloat16)
    tokens = Sampler(CPU)(logits, batch(4, temperature=0.0))
    assert tokens.dtype is torch.int64
    assert torch.equal(tokens, logits.float().argmax(dim=-1))


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    generator = torch.Generator().manual_seed(2)
    row = torch.randn(1, 400, generator=generator)
    others = torch.randn(3, 400, generator=generator)
    for step in range(20):
        alone = Sampler(CPU, seed=0)(row, batch(1, seeds=[77], steps=[step]))
        mixed = Sampler(CPU, seed=99)(
            torch.cat([others[:2], row, others[2:]]),
            batch(4, seeds=[None, 5, 77, None], steps=[3, step, step, 0], top_k=[0, 0, 0, 10]),
        )
        assert alone[0] == mixed[2], f"step {step}"


def test_seeded_draws_vary_with_the_step_and_the_seed() -> None:
    logits = torch.zeros(1, 1000)  # uniform: every draw is a fresh token
    sampler = Sampler(CPU)
    by_step = {int(sampler(logits, batch(1, seeds=[1], steps=[step]))[0]) for step in range(30)}
    by_seed = {int(sampler(logits, batch(1, seeds=[seed], steps=[0]))[0]) for seed in range(30)}
    assert len(by_step) > 20 and len(by_seed) > 20


def test_unseeded_rows_use_the_runner_generator() -> None:
    logits = torch.zeros(16, 1000)
    first = Sampler(CPU, seed=3)(logits, batch(16))
    again = Sampler(CPU, seed=3)(logits, batch(16))
    other = Sampler(CPU, seed=4)(logits, batch(16))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_seeded_rows_are_reproducible_across_samplers() -> None:
    """No generator state: the same (seed, step) draws the same token in any sampler."""
    logits = torch.zeros(1, 1000)
    first = [int(Sampler(CPU, seed=1)(logits, batch(1, seeds=[9], steps=[s]))[0]) for s in range(5)]
    again = [int(Sampler(CPU, seed=2)(logits, batch(1, seeds=[9], steps=[s]))[0]) for s in range(5)]
    assert first == again


def test_top_k_never_leaves_the_top_k() -> None:
    generator = torch.Generator().manual_seed(5)
    row = torch.randn(200, generator=generator)
    allowed = set(row.topk(3).indices.tolist())
    tokens = Sampler(CPU)(row.expand(4000, -1).contiguous(), batch(4000, top_k=3))
    assert set(tokens.tolist()) == allowed  # each of the three is drawn, nothing else


@pytest.mark.parametrize(
    ("top_p", "allowed"),
    [(0.05, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (0.97, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_the_smallest_nucleus(top_p: float, allowed: set[int]) -> None:
    probs = [0.5, 0.3, 0.1, 0.06, 0.04]
    tokens = Sampler(CPU)(logits_for(probs, 4000), batch(4000, top_p=top_p))
    assert set(tokens.tolist()) == allowed


@pytest.mark.parametrize(("top_p", "allowed"), [(0.9, {0, 1}), (0.6, {0})])
def test_top_p_applies_after_top_k(top_p: float, allowed: set[int]) -> None:
    # After top-k=2 the kept probabilities are 0.625 / 0.375; top-p first would keep {0, 1}
    # for top_p=0.6 (0.5 < 0.6).
    probs = [0.5, 0.3, 0.1, 0.06, 0.04]
    tokens = Sampler(CPU)(logits_for(probs, 4000), batch(4000, top_k=2, top_p=top_p))
    assert set(tokens.tolist()) == allowed


def test_per_row_filters_in_one_batch() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    n = 3000
    top_ks = [1, 0, 3] * (n // 3)
    top_ps = [1.0, 0.65, 1.0] * (n // 3)
    tokens = Sampler(CPU)(logits_for(probs, n), batch(n, top_k=top_ks, top_p=top_ps))
    assert set(tokens[0::3].tolist()) == {0}
    assert set(tokens[1::3].tolist()) == {0, 1}
    assert set(tokens[2::3].tolist()) == {0, 1, 2}


def test_draws_follow_the_softmax_distribution() -> None:
    probs = [0.45, 0.25, 0.15, 0.1, 0.05]
    n = 20000
    observed = frequencies(Sampler(CPU)(logits_for(probs, n), batch(n)), len(probs))
    for p, f in zip(probs, observed, strict=True):
        assert abs(f - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_temperature_sharpens_and_flattens() -> None:
    probs = [0.6, 0.25, 0.1, 0.05]
    n = 8000
    logits = logits_for(probs, n)
    cold = frequencies(Sampler(CPU)(logits, batch(n, temperature=0.5)), 4)[0]
    warm = frequencies(Sampler(CPU)(logits, batch(n, temperature=2.0)), 4)[0]
    # softmax(log p / T): T=0.5 gives p^2 normalised (~0.83), T=2 gives sqrt(p) (~0.42).
    assert abs(cold - 0.36 / sum(p * p for p in probs)) < 0.03
    assert abs(warm - math.sqrt(0.6) / sum(math.sqrt(p) for p in probs)) < 0.03


def test_sampling_batch_from_params_summaries() -> None:
    from pagedinfer.domain import SamplingParams

    params = [
        SamplingParams(temperature=0.0, top_k=5),
        SamplingParams(temperature=0.8, top_p=0.9, seed=4),
    ]
    sampling = SamplingBatch.from_params(params, CPU, [0, 3])
    assert not sampling.all_greedy
    assert sampling.any_greedy
    assert not sampling.any_top_k  # only the greedy row asks for top-k
    assert sampling.any_top_p and sampling.any_seeded
    assert sampling.seeds is not None and sampling.seeds.tolist() == [NO_SEED, 4]
    assert sampling.sample_steps is not None and sampling.sample_steps.tolist() == [0, 3]
    assert sampling.temperatures is not None
    assert sampling.temperatures.tolist() == pytest.approx([0.0, 0.8])
    assert SamplingBatch.from_params([params[0]], CPU).all_greedy


def test_the_fused_race_runs_only_for_temperature_only_steps_on_cuda() -> None:
    cuda = torch.device("cuda")  # a device name: no CUDA needed to build it
    processing = ProcessingStep(
        batch_rows=None,
        table_rows=torch.zeros(1, dtype=torch.int64),
        held_back=None,
        any_bias=True,
        any_penalties=False,
        any_min_p=False,
    )
    plain = batch(3, temperature=[0.0, 0.7, 1.0], seeds=[None, 5, None])
    assert uses_fused_race(cuda, plain, None)
    assert uses_fused_race(cuda, batch(2, temperature=0.5), None)
    assert not uses_fused_race(CPU, plain, None)
    assert not uses_fused_race(cuda, plain, processing)
    assert not uses_fused_race(cuda, batch(3, temperature=0.0), None)  # all greedy: argmax
    assert not uses_fused_race(cuda, batch(3, temperature=0.7, top_k=[0, 5, 0]), None)
    assert not uses_fused_race(cuda, batch(3, temperature=0.7, top_p=[1.0, 1.0, 0.9]), None)


def test_the_race_path_keys_unseeded_rows_with_the_samplers_own_random() -> None:
    """``Sampler.race`` (the CUDA fast path; here the kernel under Triton's interpreter): the
    unseeded rows' noise is keyed by one ``random.Random(seed).getrandbits(63)`` per step
    (seed 0 by default), greedy rows (temperature below the epsilon) are argmax."""
    from pagedinfer.adapters.kernels.race_sample import race_sample

    rows, vocab = 12, 40
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3))
    temperatures = [0.0, GREEDY_TEMPERATURE_EPSILON / 10] + [1.0] * (rows - 3) + [0.7]
    sampling = batch(
        rows, temperature=temperatures, seeds=[None] * (rows - 1) + [11], steps=[0] * rows
    )
    assert sampling.temperatures is not None and sampling.seeds is not None
    sampler = Sampler(CPU)
    assert sampler.device == CPU
    keys = random.Random(0)
    for _ in range(2):  # a new key each step
        expected = race_sample(
            logits,
            sampling.temperatures,
            sampling.seeds,
            sampling.sample_steps,
            step_key=keys.getrandbits(63),
            greedy_epsilon=GREEDY_TEMPERATURE_EPSILON,
        )
        tokens = sampler.race(logits, sampling)
        assert torch.equal(tokens, expected)
        assert torch.equal(tokens[:2], logits[:2].argmax(dim=-1))


def test_the_default_seed_is_zero() -> None:
    logits = torch.zeros(64, 30)
    sampling = batch(64)
    first = Sampler(CPU)(logits, sampling)
    assert torch.equal(first, Sampler(CPU, seed=0)(logits, sampling))
    assert not torch.equal(first, Sampler(CPU, seed=1)(logits, sampling))


def test_filtered_logits_are_processed_then_tempered() -> None:
    processors = LogitsProcessors(6, CPU)
    processors.add(0, SamplingParams(allowed_token_ids=[1, 4], logit_bias={4: 2.0}))
    step = processors.plan([0, 1], lambda row: 0)
    inf = math.inf
    expected_first = [-inf, 0.0, -inf, -inf, 4.0, -inf]  # bias 2 / temperature 0.5
    out = filtered_logits(torch.zeros(2, 6), batch(2, temperature=[0.5, 1.0]), processors, step)
    assert out.tolist() == [expected_first, [0.0] * 6]
    greedy = filtered_logits(torch.zeros(2, 6), batch(2, temperature=0.0), processors, step)
    assert greedy.tolist() == [[-inf, 0.0, -inf, -inf, 2.0, -inf], [0.0] * 6]


def test_a_greedy_rows_filtered_logits_ignore_its_top_k() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    sampling = batch(2, temperature=[0.0, 1.0], top_k=[1, 2])
    out = filtered_logits(logits.clone(), sampling)
    assert out.tolist() == [[0.0, 1.0, 2.0, 3.0], [-math.inf, -math.inf, 2.0, 3.0]]


def test_a_temperature_at_the_epsilon_is_sampled_as_the_host_decides() -> None:
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE_EPSILON).is_greedy
    logits = torch.zeros(65, 16)  # flat: a sampled row draws any token, argmax is token 0
    temperatures = [0.0] + [GREEDY_TEMPERATURE_EPSILON] * 64  # with a greedy row
    tokens = Sampler(CPU)(logits, batch(65, temperature=temperatures))
    assert tokens[0] == 0 and len(set(tokens.tolist())) > 1


def test_top_p_keeps_the_set_whose_mass_reaches_top_p_exactly() -> None:
    """Four equal probabilities (0.25, exact in float32) and top_p 0.5: two tokens reach 0.5,
    so two are kept, not three (vLLM's rule: drop while the mass below stays <= 1 - top_p)."""
    out = filtered_logits(torch.zeros(1, 4), batch(1, top_p=0.5))
    assert int(out.isfinite().sum()) == 2
