"""Turn logits into token ids: greedy, or temperature / top-k / top-p plus an exponential race.

Sampling uses the "exponential race" form of the Gumbel-max trick: with independent
``E_i ~ Exp(1)``, ``argmax_i p_i / E_i`` is distributed as ``Categorical(p)``. It needs no
cumulative sum or search, so a whole batch samples in a few vectorised passes. The only
randomness is the noise tensor, so a request with a seed draws its noise row from a generator
keyed by ``(seed, sample_step)`` and gets the same token whatever else is in the batch and
however often it was preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.sampling import GREEDY_TEMPERATURE_EPSILON, SamplingParams

__all__ = ["Sampler", "SamplingBatch", "SamplingTable", "derive_seed"]

_MASK64 = (1 << 64) - 1


def derive_seed(seed: int, step: int) -> int:
    """A well-mixed 64-bit generator seed for sample ``step`` of a request seeded ``seed``.

    splitmix64 finalisers over both inputs: nearby seeds and steps give unrelated streams.
    """

    def mix(value: int) -> int:
        value = (value + 0x9E3779B97F4A7C15) & _MASK64
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
        return value ^ (value >> 31)

    return mix(mix(seed & _MASK64) ^ step)


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """The per-row sampling parameters of one step, as tensors plus host-side summaries."""

    temperatures: torch.Tensor  # [n] float32, below GREEDY_TEMPERATURE_EPSILON = greedy
    top_ks: torch.Tensor  # [n] int64, 0 = off
    top_ps: torch.Tensor  # [n] float32, 1 = off
    seeds: list[int | None]
    sample_steps: list[int]
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def from_rows(
        cls, params: list[SamplingParams], sample_steps: list[int], device: torch.device
    ) -> SamplingBatch:
        """One row per sample: its request's parameters and the sample's index in it."""
        # The host decides which rows are greedy and the device mask follows (temperature
        # 0.0), so the two can never disagree about a temperature near the epsilon.
        temperatures = [
            0.0 if p.temperature < GREEDY_TEMPERATURE_EPSILON else float(p.temperature)
            for p in params
        ]
        top_ks = [p.top_k for p in params]
        top_ps = [float(p.top_p) for p in params]
        sampled_rows = [i for i, t in enumerate(temperatures) if t != 0.0]
        return cls(
            temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            seeds=[p.seed for p in params],
            sample_steps=sample_steps,
            all_greedy=not sampled_rows,
            any_greedy=len(sampled_rows) < len(params),
            any_top_k=any(top_ks[i] > 0 for i in sampled_rows),
            any_top_p=any(top_ps[i] < 1.0 for i in sampled_rows),
        )


class SamplingTable:
    """Every live request's sampling parameters by slot, kept current by the plans' deltas.

    The host-side form of the per-slot table of ``domain/plan.py``: each plan's
    ``released_slots`` and ``new_requests`` are applied (:meth:`update`), then the step's
    per-row :class:`SamplingBatch` is looked up from ``plan.sample_slots`` (:meth:`batch`),
    the one place per-row parameter lists are built. Lives on the rank that samples.
    """

    def __init__(self) -> None:
        self._params: dict[int, SamplingParams] = {}
        self._prompt_lens: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._params)

    def update(self, plan: BatchPlan) -> None:
        """Apply the plan's deltas: releases first, then new requests (idempotent)."""
        for slot in plan.released_slots:
            self._params.pop(slot, None)
            self._prompt_lens.pop(slot, None)
        for request in plan.new_requests:
            self._params[request.slot] = request.params
            self._prompt_lens[request.slot] = request.num_prompt_tokens

    def batch(self, plan: BatchPlan, device: torch.device) -> SamplingBatch:
        """The sampled rows' parameters; the sample index of row ``j`` in its request is
        ``positions[sample_indices[j]] + 1 - num_prompt_tokens``."""
        params = self._params
        prompt_lens = self._prompt_lens
        positions = plan.positions
        rows = zip(plan.sample_indices, plan.sample_slots, strict=True)
        steps = [positions[index] + 1 - prompt_lens[slot] for index, slot in rows]
        return SamplingBatch.from_rows([params[slot] for slot in plan.sample_slots], steps, device)


class Sampler:
    """Samples one token per row of ``logits``; greedy rows are exactly argmax.

    A row is greedy when its temperature is below ``GREEDY_TEMPERATURE_EPSILON`` (0 included).
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        # Noise for rows without a per-request seed.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed & _MASK64)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """``logits [n, vocab]`` -> token ids ``[n]`` (int64)."""
        logits = logits.float()
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        temperatures = batch.temperatures
        # Below the epsilon a division would overflow to inf and the softmax to NaN.
        is_greedy = temperatures < GREEDY_TEMPERATURE_EPSILON
        greedy = logits.argmax(dim=-1) if batch.any_greedy else None
        # Greedy rows are divided by 1 and their sample discarded below.
        scaled = logits / torch.where(is_greedy, 1.0, temperatures).unsqueeze(1)
        if batch.any_top_k or batch.any_top_p:
            scaled = _filter_top_k_top_p(scaled, batch)
        probs = scaled.softmax(dim=-1)
        sampled = probs.div_(self._exponential_noise(probs, batch)).argmax(dim=-1)
        return sampled if greedy is None else torch.where(is_greedy, greedy, sampled)

    def _exponential_noise(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """``Exp(1)`` noise shaped like ``probs``: seeded rows from their own generators.

        Drawn as ``-log(U)``, ``U ~ Uniform[0, 1)``: several times faster on CPU than
        ``Tensor.exponential_``, and never exactly 0 (``U < 1``), so ``p / E`` is never NaN;
        ``U = 0`` gives ``E = inf`` and that token simply loses.
        """
        uniform = torch.empty_like(probs)
        seeded = [i for i, seed in enumerate(batch.seeds) if seed is not None]
        if len(seeded) < len(batch.seeds):
            uniform.uniform_(generator=self.generator)
        for row in seeded:
            seed = batch.seeds[row]
            assert seed is not None
            generator = torch.Generator(device=probs.device)
            generator.manual_seed(derive_seed(seed, batch.sample_steps[row]))
            uniform[row].uniform_(generator=generator)
        return uniform.log_().neg_()


def _filter_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf."""
    vocab = logits.shape[-1]
    if not batch.any_top_p:
        # top-k only: the k-th largest value is a threshold; no full sort needed.
        ks = torch.where((batch.top_ks > 0) & (batch.top_ks < vocab), batch.top_ks, vocab)
        max_k = int(ks.max().item())
        top_values = logits.topk(max_k, dim=-1).values
        threshold = top_values.gather(1, (ks - 1).unsqueeze(1))
        return logits.masked_fill_(logits < threshold, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if batch.any_top_k:
        ks = torch.where((batch.top_ks > 0) & (batch.top_ks < vocab), batch.top_ks, vocab)
        threshold = sorted_logits.gather(1, (vocab - ks).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < threshold, float("-inf"))
    # Ascending order: drop tokens while the mass at or below them stays <= 1 - top_p, i.e.
    # keep the smallest high-probability set whose mass reaches top_p; always keep the top one.
    cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    drop = cumulative <= (1.0 - batch.top_ps).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
