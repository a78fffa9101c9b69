"""The torch twin of the fused race sampler (:mod:`pagedinfer.adapters.kernels.race_sample`).

A test oracle, not a code path: ``argmax_v (logits_v / T - log(-log U_v))`` with ``U`` from
:func:`~pagedinfer.adapters.sampling.noise.seeded_uniform_torch`, seeded rows keyed by
``(seed, step)`` and unseeded rows by ``(step_key, row index)``; greedy rows take the argmax of
the logits. Returns the keys too, so that tests can tell a real disagreement from a float
near-tie.
"""

from __future__ import annotations

import torch

from pagedinfer.adapters.sampling.batch import NO_SEED
from pagedinfer.adapters.sampling.noise import seeded_uniform_torch
from pagedinfer.domain.sampling import GREEDY_TEMPERATURE_EPSILON


def race_keys_torch(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor | None,
    step_key: int,
) -> torch.Tensor:
    """The race's float32 keys ``[n, vocab]`` (greedy rows: the logits themselves)."""
    num_rows, vocab = logits.shape
    unseeded = seeds == NO_SEED
    rows = torch.arange(num_rows, device=seeds.device)
    key_seeds = torch.where(unseeded, torch.full_like(seeds, step_key), seeds)
    key_steps = rows if steps is None else torch.where(unseeded, rows, steps)
    uniform = seeded_uniform_torch(key_seeds, key_steps, vocab)
    greedy = temperatures < GREEDY_TEMPERATURE_EPSILON
    logits = logits.float()
    scaled = logits / temperatures.masked_fill(greedy, 1.0).unsqueeze(1)
    sampled = scaled - uniform.log().neg().log()
    return torch.where(greedy.unsqueeze(1), logits, sampled)


def race_sample_torch(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor | None,
    step_key: int,
) -> torch.Tensor:
    """Token ids ``[n]`` int64 of the fused race, computed with torch ops."""
    return race_keys_torch(logits, temperatures, seeds, steps, step_key).argmax(dim=-1)
