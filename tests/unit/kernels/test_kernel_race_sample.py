"""The fused race sampler (``kernels/race_sample.py``) against its torch twin and the sampler.

Under the interpreter on CPU (compiled on CUDA when there is one). Oracles: exact ``argmax``
for greedy rows; ``tests/race_twin.py`` (the log form with the seed rule's uniforms) for every
row; today's :class:`~pagedinfer.adapters.sampling.sampler.Sampler` (the ratio form) for seeded
rows, wherever the race's best key is not a float near-tie; a chi-square bound on many unseeded
draws of a known distribution.
"""

from __future__ import annotations

import pytest
import torch

from pagedinfer.adapters.sampling.batch import NO_SEED, SamplingBatch
from pagedinfer.adapters.sampling.sampler import Sampler
from pagedinfer.domain.sampling import GREEDY_TEMPERATURE_EPSILON
from race_twin import race_keys_torch, race_sample_torch

DTYPES = [torch.float32, torch.float16]
# 1 and 3: a single partial tile; 1025: a partial second chunk; 20000: chunks of two tiles.
VOCABS = [1, 3, 1000, 1025, 3000, 20000]
# 0.001 quantile of chi-square with 7 degrees of freedom.
CHI2_7_CRITICAL = 24.32
NEAR_TIE = 1e-3


def race(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor | None,
    step_key: int,
) -> torch.Tensor:
    from pagedinfer.adapters.kernels.race_sample import race_sample

    return race_sample(
        logits,
        temperatures,
        seeds,
        steps,
        step_key=step_key,
        greedy_epsilon=GREEDY_TEMPERATURE_EPSILON,
    )


def random_rows(
    rows: int, vocab: int, dtype: torch.dtype, device: torch.device, seed: int
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(rows, vocab, generator=generator)).to(dtype).to(device)


def clear_winners(keys: torch.Tensor) -> torch.Tensor:
    """Rows whose best key beats the runner-up by more than a float near-tie (bool ``[n]``)."""
    if keys.shape[1] == 1:
        return torch.ones(keys.shape[0], dtype=torch.bool, device=keys.device)
    top2 = keys.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) > NEAR_TIE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_greedy_rows_are_exactly_argmax(
    device: torch.device, dtype: torch.dtype, vocab: int
) -> None:
    rows = 4
    logits = random_rows(rows, vocab, dtype, device, seed=vocab)
    temperatures = torch.zeros(rows, device=device)
    seeds = torch.full((rows,), NO_SEED, device=device)
    tokens = race(logits, temperatures, seeds, None, step_key=7)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [1, 5])
def test_every_row_matches_the_torch_twin(
    device: torch.device, dtype: torch.dtype, vocab: int, rows: int
) -> None:
    logits = random_rows(rows, vocab, dtype, device, seed=rows * vocab)
    # The parameters as the sampling table hands them: strided columns of wider tensors.
    floats = torch.tensor([[0.5, t] for t in [0.0, 1.0, 0.7, 2.5, 1e-6][:rows]], device=device)
    temperatures = floats[:, 1]
    seeds_and_steps = [(NO_SEED, 0), (5, 3), (NO_SEED, 0), (2**63 - 1, 2**20), (2**32 + 1, 11)]
    ints = torch.tensor(seeds_and_steps[:rows], device=device)
    seeds, steps = ints[:, 0], ints[:, 1]
    assert seeds.stride(0) == temperatures.stride(0) == 2
    step_key = 0x5DEECE66D * (rows + vocab)
    tokens = race(logits, temperatures, seeds, steps, step_key)
    expected = race_sample_torch(logits, temperatures, seeds, steps, step_key)
    clear = clear_winners(race_keys_torch(logits, temperatures, seeds, steps, step_key))
    assert clear.float().mean() > 0.5
    assert torch.equal(tokens[clear], expected[clear])


@pytest.mark.parametrize("dtype", DTYPES)
def test_seeded_rows_sample_what_the_unfused_sampler_samples(
    device: torch.device, dtype: torch.dtype
) -> None:
    rows, vocab = 5, 3000
    logits = random_rows(rows, vocab, dtype, device, seed=3)
    params = [(0.8, 1), (1.0, 2**40 + 3), (1.5, 99), (0.3, 0), (1.0, 2**62)]
    temperatures = torch.tensor([t for t, _ in params], device=device)
    seeds = torch.tensor([s for _, s in params], device=device)
    compared = 0
    for step in range(6):
        steps = torch.full((rows,), step, device=device)
        tokens = race(logits, temperatures, seeds, steps, step_key=step)
        unfused = Sampler(torch.device("cpu"))(
            logits.cpu(),
            SamplingBatch(
                all_greedy=False,
                any_seeded=True,
                temperatures=temperatures.cpu(),
                top_ks=torch.zeros(rows, dtype=torch.int64),
                top_ps=torch.ones(rows),
                seeds=seeds.cpu(),
                sample_steps=steps.cpu(),
            ),
        )
        keys = race_keys_torch(logits, temperatures, seeds, steps, step_key=step)
        clear = clear_winners(keys).cpu()
        assert torch.equal(tokens.cpu()[clear], unfused[clear]), step
        compared += int(clear.sum())
    assert compared > rows * 6 // 2


def test_unseeded_rows_follow_the_tempered_distribution(device: torch.device) -> None:
    """512 unseeded rows (one draw each) of 8 tokens at temperature 2: a chi-square bound that
    a missing temperature, a missing log or a flipped sign fails by far (see the assertion on
    the untempered distribution below)."""
    rows = 512
    probs = torch.tensor([0.4, 0.2, 0.1, 0.1, 0.08, 0.06, 0.04, 0.02], dtype=torch.float64)
    temperature = 2.0
    tempered = probs.pow(1 / temperature)
    tempered /= tempered.sum()
    logits = probs.log().float().expand(rows, -1).contiguous().to(device)
    temperatures = torch.full((rows,), temperature, device=device)
    seeds = torch.full((rows,), NO_SEED, device=device)
    tokens = race(logits, temperatures, seeds, None, step_key=2**62 + 12345).cpu()
    counts = torch.bincount(tokens, minlength=8).double()

    def chi_square(expected: torch.Tensor) -> float:
        return float(((counts - rows * expected) ** 2 / (rows * expected)).sum())

    assert chi_square(tempered) < CHI2_7_CRITICAL, counts.tolist()
    assert chi_square(probs) > 2 * CHI2_7_CRITICAL, counts.tolist()


def test_unseeded_rows_differ_between_rows_and_between_step_keys(device: torch.device) -> None:
    rows, vocab = 4, 1000
    logits = torch.zeros(rows, vocab, device=device)  # uniform: the noise alone decides
    temperatures = torch.ones(rows, device=device)
    seeds = torch.full((rows,), NO_SEED, device=device)
    first = race(logits, temperatures, seeds, None, step_key=1)
    again = race(logits, temperatures, seeds, None, step_key=1)
    other = race(logits, temperatures, seeds, None, step_key=2)
    assert torch.equal(first, again)
    assert len(set(first.tolist())) == rows
    assert not torch.equal(first, other)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_lowest_index(device: torch.device, dtype: torch.dtype) -> None:
    # 20000 tokens: tiles of 1024, chunks of two tiles.
    vocab = 20000
    ties = [
        [700, 900],  # one tile
        [1500, 2500, 19999],  # different chunks
        [5, 1029, 2050],  # one lane of two tiles of a chunk, then the next chunk
        [1000, 1030],  # the later tile's tie sits in a lower lane
    ]
    logits = torch.zeros(len(ties) + 2, vocab, dtype=dtype)
    for row, indices in enumerate(ties):
        logits[row, indices] = 2.0
    logits[len(ties)] = 1.0  # all equal
    logits[len(ties) + 1] = float("-inf")  # all masked
    logits = logits.to(device)
    rows = logits.shape[0]
    temperatures = torch.zeros(rows, device=device)
    seeds = torch.full((rows,), NO_SEED, device=device)
    tokens = race(logits, temperatures, seeds, None, step_key=0)
    assert tokens.tolist() == [700, 1500, 5, 1000, 0, 0]
    assert torch.equal(tokens, logits.float().argmax(dim=-1))


def test_no_rows(device: torch.device) -> None:
    empty = torch.empty(0, device=device)
    tokens = race(torch.empty(0, 10, device=device), empty, empty.long(), None, step_key=0)
    assert tokens.shape == (0,) and tokens.dtype == torch.int64


def test_step_keys_that_agree_after_a_32_bit_fold_draw_different_tokens(
    device: torch.device,
) -> None:
    """The sampler's step keys 26,946 and 139,035 for engine seed 0 folded to one 32-bit word
    under the old seed rule, so every unseeded row of those steps drew the same token; the
    row keys now keep all 64 bits of the step key."""
    step_keys = Sampler(torch.device("cpu"), seed=0).step_keys
    keys = [step_keys.getrandbits(63) for _ in range(139_036)]
    rows, vocab = 8, 1000
    logits = torch.zeros(rows, vocab, device=device)  # uniform: the noise alone decides
    temperatures = torch.ones(rows, device=device)
    seeds = torch.full((rows,), NO_SEED, device=device)
    first = race(logits, temperatures, seeds, None, step_key=keys[26_946])
    second = race(logits, temperatures, seeds, None, step_key=keys[139_035])
    assert int((first == second).sum()) <= 1  # 8 draws of 1000 tokens: equal by chance
    assert torch.equal(
        first.cpu(), race_sample_torch(logits, temperatures, seeds, None, keys[26_946]).cpu()
    )
