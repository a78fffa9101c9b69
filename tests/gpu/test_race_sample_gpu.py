"""The fused race sampler compiled for a real GPU at Qwen3's size (256 x 151936, bf16 logits).

Oracle: the torch twin (``tests/race_twin.py``) on the same inputs; the GPU's ``log`` and the
twin's may round differently, so a token may differ only where the twin's two keys are a float
near-tie. Also: the sampler dispatches to it, and row counts, step keys and parameter tensors
of either layout compile no second variant. Run with ``make test-gpu``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pagedinfer.adapters.sampling.batch import NO_SEED, SamplingBatch
from pagedinfer.adapters.sampling.sampler import Sampler
from pagedinfer.domain.sampling import GREEDY_TEMPERATURE_EPSILON
from race_twin import race_keys_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
ROWS, VOCAB = 256, 151936


def parameters(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperatures (a quarter greedy), seeds (a third seeded) and steps for ``rows`` rows."""
    generator = torch.Generator().manual_seed(seed)
    temperatures = 0.3 + 1.2 * torch.rand(rows, generator=generator)
    temperatures[::4] = 0.0
    seeds = torch.randint(0, 2**63 - 1, (rows,), generator=generator)
    seeds[torch.arange(rows) % 3 != 0] = NO_SEED
    steps = torch.randint(0, 4096, (rows,), generator=generator)
    return temperatures.to(CUDA), seeds.to(CUDA), steps.to(CUDA)


def assert_matches_twin(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor | None,
    step_key: int,
) -> None:
    keys = race_keys_torch(logits, temperatures, seeds, steps, step_key)
    expected = keys.argmax(dim=-1)
    differ = (tokens != expected).nonzero().flatten().tolist()
    for row in differ:
        ours, theirs = keys[row, tokens[row]].item(), keys[row, expected[row]].item()
        assert abs(ours - theirs) <= 1e-5 * max(1.0, abs(theirs)), (row, ours, theirs)
    assert len(differ) <= 2, differ


def test_race_sample_matches_the_twin_at_qwen3_size() -> None:
    from pagedinfer.adapters.kernels.race_sample import race_sample

    generator = torch.Generator(device=CUDA).manual_seed(0)
    logits = (4 * torch.randn(ROWS, VOCAB, generator=generator, device=CUDA)).bfloat16()
    temperatures, seeds, steps = parameters(ROWS, seed=1)
    step_key = 0x123456789ABCDEF
    tokens = race_sample(
        logits,
        temperatures,
        seeds,
        steps,
        step_key=step_key,
        greedy_epsilon=GREEDY_TEMPERATURE_EPSILON,
    )
    greedy = temperatures == 0.0
    assert torch.equal(tokens[greedy], logits[greedy].float().argmax(dim=-1))
    assert_matches_twin(tokens, logits, temperatures, seeds, steps, step_key)


def test_the_sampler_uses_the_race_with_its_own_step_keys() -> None:
    generator = torch.Generator(device=CUDA).manual_seed(2)
    logits = (4 * torch.randn(64, VOCAB, generator=generator, device=CUDA)).bfloat16()
    temperatures, seeds, _ = parameters(64, seed=3)
    seeds.fill_(NO_SEED)
    batch = SamplingBatch(
        all_greedy=False,
        any_greedy=True,
        temperatures=temperatures,
        top_ks=torch.zeros(64, dtype=torch.int64, device=CUDA),
        top_ps=torch.ones(64, device=CUDA),
        seeds=seeds,
    )
    sampler = Sampler(CUDA, seed=5)
    keys = random.Random(5)
    for _ in range(2):
        tokens = sampler(logits, batch)
        assert_matches_twin(tokens, logits, temperatures, seeds, None, keys.getrandbits(63))


def compiled_variants(kernel: Any) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton version keeps its kernel cache elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


def test_race_sample_compiles_once_for_every_row_count_and_step_key() -> None:
    from pagedinfer.adapters.kernels import race_sample as module

    before_chunks = compiled_variants(module._race_chunks_kernel)
    before_finish = compiled_variants(module._race_finish_kernel)
    logits = torch.randn(ROWS, VOCAB, device=CUDA).bfloat16()
    for index, rows in enumerate([1, 2, 3, 16, 17, 64, 255, 256]):
        temperatures, seeds, steps = parameters(rows, seed=index)
        if index % 3 == 0:
            seeds.fill_(NO_SEED)  # no seeded row: the steps may be absent
        if index % 2:
            # As the sampling table hands them: columns of wider tensors (strided, offset).
            floats = torch.stack([torch.ones_like(temperatures), temperatures], dim=1)
            ints = torch.stack([steps, seeds, steps], dim=1)
            temperatures, seeds, steps = floats[:, 1], ints[:, 1], ints[:, 2]
        module.race_sample(
            logits[:rows],
            temperatures,
            seeds,
            None if index % 3 == 0 else steps,
            step_key=[0, 1, 16, 2**31, 2**32, 2**40 + 16, 2**63 - 1, 12345][index],
            greedy_epsilon=GREEDY_TEMPERATURE_EPSILON,
        )
    torch.cuda.synchronize()
    assert compiled_variants(module._race_chunks_kernel) - before_chunks <= 1
    assert compiled_variants(module._race_finish_kernel) - before_finish <= 1
