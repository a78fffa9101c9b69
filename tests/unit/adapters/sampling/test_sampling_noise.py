"""The seeded noise rule: pinned bits, the torch twin, the Triton kernel, and its statistics.

The rule (``adapters/sampling/noise.py``) is part of the public contract: a seeded request's
output depends on it. A pure-Python transcription here pins it, so that neither a refactoring
nor a platform where int32 tensor arithmetic does not wrap can change it unnoticed.
"""

from __future__ import annotations

import math
import os

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from pagedinfer.adapters.sampling.noise import exponential_noise, row_keys, seeded_uniform_torch
from pagedinfer.adapters.sampling.sampler import Sampler
from pagedinfer.domain.sampling import MAX_SEED

M32 = 0xFFFFFFFF


def _mix(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


SALTS = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)


def rule_keys(seed: int, step: int) -> tuple[int, int]:
    """The documented row key ``(k0, k1)``: four Feistel rounds over the seed's halves."""
    left, right = seed & M32, seed >> 32
    for salt in SALTS:
        left, right = right, left ^ _mix(right ^ _mix(step ^ salt))
    return left, right


def rule_seed(k0: int, k1: int, step: int) -> int:
    """The seed whose row key at ``step`` is ``(k0, k1)``: the rounds run backwards."""
    left, right = k0, k1
    for salt in reversed(SALTS):
        left, right = right ^ _mix(left ^ _mix(step ^ salt)), left
    return right << 32 | left


def rule_uniform(seed: int, step: int, token: int) -> float:
    """The documented seed rule, in plain Python integers."""
    k0, k1 = rule_keys(seed, step)
    h = _mix(_mix(((token * 0x9E3779B9) & M32) ^ k0) + k1)
    return ((h >> 9) + 0.5) / 2**23


def old_folded_seed(seed: int) -> int:
    """The rule before the Feistel rounds folded the seed into one 32-bit word first."""
    return _mix((seed & M32) ^ _mix((seed >> 32) ^ 0x243F6A88))


# 12345 and 8,122,140,338 shared their noise under the rule's old 32-bit fold.
ROWS = [
    (0, 0),
    (1, 0),
    (0, 1),
    (12345, 678),
    (2**63 - 1, 2**20),
    (2**32 + 5, 3),
    (8_122_140_338, 678),
    (2**32 + 12345, 678),
]


def test_torch_twin_follows_the_rule_bit_for_bit() -> None:
    vocab = 300
    seeds = torch.tensor([seed for seed, _ in ROWS])
    steps = torch.tensor([step for _, step in ROWS])
    uniform = seeded_uniform_torch(seeds, steps, vocab)
    for row, (seed, step) in enumerate(ROWS):
        for token in (0, 1, 2, 157, vocab - 1):
            assert uniform[row, token].item() == rule_uniform(seed, step, token), (seed, step)


def test_pinned_values() -> None:
    """A few outputs written down (as multiples of 2**-23): the rule must never change
    silently, in its Python transcription or in the torch twin."""
    # Values of the rule with the Feistel row keys (the 32-bit fold before it gave others).
    pinned = {
        (0, 0, 0): 197206.5,
        (0, 0, 1): 2078881.5,
        (0, 0, 2): 477102.5,
        (42, 7, 0): 4463782.5,
        (42, 7, 2): 6372566.5,
        (2**63 - 1, 1000, 151935): 6184398.5,
    }
    for (seed, step, token), value in pinned.items():
        assert rule_uniform(seed, step, token) * 2**23 == value
        twin = seeded_uniform_torch(torch.tensor([seed]), torch.tensor([step]), token + 1)
        assert twin[0, token].item() * 2**23 == value


@given(
    seed=st.integers(0, MAX_SEED),
    step=st.integers(0, 2**32 - 1),
)
@settings(max_examples=50, deadline=None)
def test_row_keys_are_one_to_one_in_the_seed(seed: int, step: int) -> None:
    """The twin's row key is the rule's, and running the Feistel rounds backwards from it
    gives the seed back: at every step, distinct seeds have distinct row keys."""
    k0, k1 = row_keys(torch.tensor([seed]), torch.tensor([step]))
    keys = (int(k0[0]) & M32, int(k1[0]) & M32)
    assert keys == rule_keys(seed, step)
    assert rule_seed(*keys, step) == seed


def test_seeds_that_agree_in_their_low_32_bits_draw_different_noise() -> None:
    vocab = 64
    low = 12345
    seeds = torch.tensor([low, low + 2**32, low + 7 * 2**32, low + 2**62])
    for step in (0, 1, 1000):
        uniform = seeded_uniform_torch(seeds, torch.full((4,), step), vocab)
        for a in range(4):
            for b in range(a + 1, 4):
                # Independent rows: at most a couple of the 64 uniforms agree by chance.
                assert int((uniform[a] == uniform[b]).sum()) <= 2, (a, b, step)


def test_seeds_that_collided_under_the_32_bit_fold_draw_different_noise() -> None:
    """Issue 21 item 8: 12345 and 8,122,140,338 drew bit-identical noise at every step."""
    first, second = 12345, 8_122_140_338
    assert old_folded_seed(first) == old_folded_seed(second)  # the old rule's collision
    steps = torch.arange(8)
    one = seeded_uniform_torch(torch.full((8,), first), steps, 256)
    two = seeded_uniform_torch(torch.full((8,), second), steps, 256)
    assert int((one == two).sum()) <= 2  # 2048 uniforms, equal only by chance


def test_unseeded_step_keys_that_collided_under_the_fold_draw_different_noise() -> None:
    """The fused race keys unseeded row ``r`` of a step by ``(step key, r)``, the step keys
    being the sampler's ``random.Random(engine seed).getrandbits(63)`` draws. With engine
    seed 0, draws 26,946 and 139,035 (0-based) folded to the same 32-bit word, so every row of
    those two steps drew the same noise."""
    step_keys = Sampler(torch.device("cpu"), seed=0).step_keys
    keys = [step_keys.getrandbits(63) for _ in range(139_036)]
    first, second = keys[26_946], keys[139_035]
    assert first != second and old_folded_seed(first) == old_folded_seed(second)
    rows = torch.arange(8)
    one = seeded_uniform_torch(torch.full((8,), first), rows, 256)
    two = seeded_uniform_torch(torch.full((8,), second), rows, 256)
    assert int((one == two).sum()) <= 2


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    vocab = 97
    alone = seeded_uniform_torch(torch.tensor([5]), torch.tensor([9]), vocab)
    batch = seeded_uniform_torch(torch.tensor([1, 5, 5, 3]), torch.tensor([9, 2, 9, 9]), vocab)
    assert torch.equal(batch[2], alone[0])
    assert not torch.equal(batch[1], alone[0])  # another step
    assert not torch.equal(batch[0], alone[0])  # another seed


def test_large_vocab_is_chunked_identically() -> None:
    """Rows are processed in cache-sized chunks; the chunking must not show."""
    seeds, steps = torch.arange(5), torch.arange(5) * 3
    wide = seeded_uniform_torch(seeds, steps, 70_000)
    for row in range(5):
        assert torch.equal(
            wide[row : row + 1],
            seeded_uniform_torch(seeds[row : row + 1], steps[row : row + 1], 70_000),
        )


def test_uniforms_look_uniform_and_independent() -> None:
    uniform = seeded_uniform_torch(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert abs(uniform.mean().item() - 0.5) < 0.005
    assert abs(uniform.var().item() - 1 / 12) < 0.002
    # Neighbouring tokens and neighbouring seeds are uncorrelated.
    flat = uniform - 0.5
    assert abs((flat[:, 1:] * flat[:, :-1]).mean().item()) < 0.002
    assert abs((flat[1:] * flat[:-1]).mean().item()) < 0.002


def test_the_race_follows_the_softmax_with_seeded_noise() -> None:
    """argmax p / E over seeds 0..N-1 draws each token with probability p."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    draws = 20_000
    uniform = seeded_uniform_torch(torch.arange(draws), torch.full((draws,), 3), 4)
    tokens = (probs / -uniform.log()).argmax(dim=-1)
    frequencies = torch.bincount(tokens, minlength=4).double() / draws
    for frequency, p in zip(frequencies.tolist(), probs.tolist(), strict=True):
        assert abs(frequency - p) < 4 * math.sqrt(p * (1 - p) / draws)


def test_exponential_noise_mixes_generator_and_seeded_rows() -> None:
    generator = torch.Generator().manual_seed(0)
    seeds = torch.tensor([0, 11, 0, 13])
    steps = torch.tensor([0, 4, 0, 5])
    seeded = torch.tensor([False, True, False, True])
    noise = exponential_noise((4, 50), generator=generator, seeds=seeds, steps=steps, seeded=seeded)
    expected = -seeded_uniform_torch(seeds[[1, 3]], steps[[1, 3]], 50).log()
    assert torch.equal(noise[[1, 3]], expected)
    plain = exponential_noise((4, 50), generator=torch.Generator().manual_seed(0))
    assert torch.equal(noise[[0, 2]], plain[[0, 2]])  # unseeded rows: the generator's draws
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise[[1, 3]]).all())


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1",
)
def test_kernel_matches_the_twin_bit_for_bit() -> None:
    from pagedinfer.adapters.kernels.exponential_noise import exponential_noise_

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab = 3000  # two blocks, the second ragged
    seeds = torch.tensor([seed for seed, _ in ROWS], device=device)
    steps = torch.tensor([step for _, step in ROWS], device=device)
    seeded = torch.tensor([True, True, False, True, True, False, True, True], device=device)
    uniform = torch.rand(len(ROWS), vocab, generator=torch.Generator().manual_seed(1)).to(device)
    noise = uniform.clone()

    exponential_noise_(noise, seeds, steps, seeded)

    expected_uniform = seeded_uniform_torch(seeds, steps, vocab)
    rows = seeded.nonzero().flatten()
    exact = -expected_uniform[rows].double().log()
    torch.testing.assert_close(noise[rows].double(), exact, rtol=1e-6, atol=0)
    uniforms = uniform.clone()
    exponential_noise_(uniforms, seeds, steps, seeded, take_log=False)
    assert torch.equal(uniforms[rows], expected_uniform[rows])  # the same bits
    plain = (~seeded).nonzero().flatten()
    torch.testing.assert_close(noise[plain], -uniform[plain].log(), rtol=1e-6, atol=0)
