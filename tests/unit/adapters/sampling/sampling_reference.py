"""Sampling written out from the definitions in NumPy (float64): the tests' reference.

vLLM's semantics and order: ``allowed_token_ids`` and ``logit_bias`` on the raw logits, then
the penalties (repetition on every token seen in the prompt or the completion: a positive
logit divided by it, any other multiplied; frequency subtracted per completion occurrence;
presence subtracted once per token in the completion), then the temperature, then

* ``min_p`` keeps the tokens whose probability is at least ``min_p`` times the largest;
* ``top_k`` keeps the ``k`` most likely of those (every token tied with the k-th is kept;
  ``k`` 0 or at least the vocabulary keeps them all);
* ``top_p`` renormalises what is left and keeps the smallest set of most likely tokens whose
  mass reaches ``top_p`` (``>=``), always at least the most likely one (which of two tokens
  tied at that boundary is kept is not specified: callers avoid such ties);

and the token is drawn from the softmax over the kept tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedinfer.domain.sampling import SamplingParams

__all__ = [
    "chi_square",
    "chi_square_p_value",
    "kept_tokens",
    "near_a_boundary",
    "processed_logits",
    "sampling_distribution",
]


def _softmax(z: np.ndarray) -> np.ndarray:
    p = np.exp(z - z.max())
    return p / p.sum()


def processed_logits(
    logits: np.ndarray,
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
) -> np.ndarray:
    """Allowed ids, bias and penalties on raw logits (float64 ``[vocab]``)."""
    z = logits.astype(np.float64).copy()
    if params.allowed_token_ids is not None:
        mask = np.full(len(z), -np.inf)
        mask[list(params.allowed_token_ids)] = 0.0
        z += mask
    for token, bias in (params.logit_bias or {}).items():
        z[token] += bias
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(z))
    seen = counts > 0
    seen[list(prompt)] = True
    r = params.repetition_penalty
    z = np.where(seen, np.where(z > 0, z / r, z * r), z)
    z -= params.frequency_penalty * counts
    z -= params.presence_penalty * (counts > 0)
    return z


def kept_tokens(z: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Which tokens a sampled row may draw (bool ``[vocab]``) from processed logits ``z``."""
    p = _softmax(z.astype(np.float64) / params.temperature)
    kept = p > 0
    if params.min_p > 0:
        kept &= p >= params.min_p * p.max()
    if 0 < params.top_k < kept.sum():
        kth_largest = np.sort(p[kept])[::-1][params.top_k - 1]
        kept &= p >= kth_largest
    if params.top_p < 1:
        q = np.where(kept, p, 0.0)
        q /= q.sum()
        nucleus = np.zeros_like(kept)
        mass = 0.0
        for token in np.argsort(-q, kind="stable"):
            nucleus[token] = True
            mass += q[token]
            if mass >= params.top_p:
                break
        kept = nucleus
    return kept


def near_a_boundary(z: np.ndarray, params: SamplingParams, margin: float) -> bool:
    """Whether a perturbation of about ``margin`` could move a token across the ``min_p``
    or ``top_p`` boundary (relative to the top probability, resp. in mass)."""
    p = _softmax(z.astype(np.float64) / params.temperature)
    if params.min_p > 0 and np.any(np.abs(p - params.min_p * p.max()) < margin * p.max()):
        return True
    if params.top_p < 1:
        before_top_p = kept_tokens(
            z,
            SamplingParams(temperature=params.temperature, min_p=params.min_p, top_k=params.top_k),
        )
        q = np.sort(np.where(before_top_p, p, 0.0) / p[before_top_p].sum())[::-1]
        if np.any(np.abs(np.cumsum(q) - params.top_p) < margin):
            return True
    return False


def sampling_distribution(
    logits: np.ndarray,
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
) -> np.ndarray:
    """The probability of drawing each token (float64 ``[vocab]``) for a sampled row."""
    z = processed_logits(logits, params, prompt, output)
    kept = kept_tokens(z, params)
    return np.where(kept, _softmax(np.where(kept, z / params.temperature, -np.inf)), 0.0)


def chi_square(
    counts: np.ndarray, expected: np.ndarray, min_expected: float = 5.0
) -> tuple[float, int]:
    """Pearson's chi-square of observed ``counts`` against ``expected`` counts (same sum):
    ``(statistic, degrees of freedom)``. Bins expecting fewer than ``min_expected`` are
    pooled into one (joined to the smallest other bin if the pool still expects less), as
    the test's approximation requires; bins expecting nothing must be empty (the caller
    checks that: no draw may fall outside the kept set)."""
    small = expected < min_expected
    o = counts[~small].astype(np.float64)
    e = expected[~small].astype(np.float64)
    pooled_o, pooled_e = float(counts[small].sum()), float(expected[small].sum())
    if pooled_e >= min_expected or not len(e):
        o, e = np.append(o, pooled_o), np.append(e, pooled_e)
    elif pooled_e > 0:  # too small for a bin of its own: join the smallest bin
        o[e.argmin()] += pooled_o
        e[e.argmin()] += pooled_e
    return float(((o - e) ** 2 / e).sum()), len(o) - 1


def chi_square_p_value(statistic: float, dof: int) -> float:
    """``P(X >= statistic)`` for ``X ~ chi-square(dof)`` (1.0 when ``dof`` is 0)."""
    if dof < 1:
        return 1.0
    # The regularised upper incomplete gamma function Q(dof / 2, statistic / 2).
    a = torch.tensor(dof / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(statistic / 2, dtype=torch.float64)))
