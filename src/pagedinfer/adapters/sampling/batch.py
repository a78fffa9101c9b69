"""One step's sampling parameters for the sampled rows: :class:`SamplingBatch`.

The executor gathers it from the persistent per-slot table
(:mod:`pagedinfer.adapters.sampling.table`); the
:class:`~pagedinfer.adapters.sampling.sampler.Sampler` reads it. It lives in a module of its
own so that the table, the logits processors and the sampler can all import it without
importing one another in a circle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedinfer.domain.sampling import SamplingParams

__all__ = ["NO_SEED", "SamplingBatch"]

NO_SEED = -1
"""A row's seed when its request has none (seeds are in ``[0, 2**63 - 1]``)."""


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """The sampled rows' parameters for one step, and which sampler passes they need.

    The tensors are ``None`` when every row is greedy (the sampler then only takes the
    argmax). The flags may be a superset of what this step's rows need (the table counts live
    requests, not rows): a pass a row does not need leaves that row unchanged. ``max_top_k``
    bounds the k of every sampled row whose top-k is on (``0 < k``; capped at the vocabulary),
    known on the host so ``topk`` needs no device read; 0 means no bound is known (the
    vocabulary). Greedy rows and rows with top-k off neither count towards it nor are
    filtered by top-k, whatever their ``top_ks`` entry holds. ``slots`` name each row's
    table row (for per-request state beyond these parameters).
    """

    all_greedy: bool
    any_greedy: bool = False
    any_top_k: bool = False
    any_top_p: bool = False
    any_seeded: bool = False
    max_top_k: int = 0
    slots: torch.Tensor | None = None  # [n] int32
    temperatures: torch.Tensor | None = None  # [n] float32, 0 = greedy
    top_ks: torch.Tensor | None = None  # [n] int64, 0 = off
    top_ps: torch.Tensor | None = None  # [n] float32, 1 = off
    seeds: torch.Tensor | None = None  # [n] int64, NO_SEED = unseeded
    sample_steps: torch.Tensor | None = None  # [n] int64, set when any_seeded

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        device: torch.device,
        sample_steps: Sequence[int] | None = None,
        *,
        vocab_size: int = 1 << 31,
    ) -> SamplingBatch:
        """A batch with one row per ``params`` entry (tests and one-off steps; the engine's
        steps gather their rows from the :class:`~pagedinfer.adapters.sampling.table.
        SamplingTable`). ``sample_steps`` key the seeded rows' noise (default 0)."""
        sampled = [p for p in params if not p.is_greedy]
        if not sampled:
            return cls(all_greedy=True)
        top_ks = [p.top_k for p in sampled if p.top_k > 0]
        steps = list(sample_steps) if sample_steps is not None else [0] * len(params)
        any_seeded = any(p.seed is not None for p in sampled)
        return cls(
            all_greedy=False,
            any_greedy=len(sampled) < len(params),
            any_top_k=bool(top_ks),
            any_top_p=any(p.top_p < 1.0 for p in sampled),
            any_seeded=any_seeded,
            max_top_k=min(max(top_ks, default=0), vocab_size),
            temperatures=torch.tensor(
                [0.0 if p.is_greedy else p.temperature for p in params],
                dtype=torch.float32,
                device=device,
            ),
            top_ks=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seeds=torch.tensor(
                [NO_SEED if p.seed is None else p.seed for p in params],
                dtype=torch.int64,
                device=device,
            ),
            sample_steps=torch.tensor(steps, dtype=torch.int64, device=device)
            if any_seeded
            else None,
        )
