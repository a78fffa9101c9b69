"""Turn logits into token ids: greedy, or temperature / top-k / top-p plus an exponential race.

Sampling uses the "exponential race" form of the Gumbel-max trick: with independent
``E_i ~ Exp(1)``, ``argmax_i p_i / E_i`` is distributed as ``Categorical(p)``. It needs no
cumulative sum or search, so a whole batch samples in a few vectorised passes. The only
randomness is the noise tensor (:mod:`pagedinfer.adapters.sampling.noise`): unseeded rows take
it from the engine's generator, seeded rows from a counter-based hash of ``(seed, sample step,
token)``, so a seeded request gets the same tokens whatever else is in the batch and however
often it was preempted and recomputed, with no generator object per row.

A step's parameters arrive as a
:class:`~pagedinfer.adapters.sampling.batch.SamplingBatch`, gathered from the persistent
per-slot table (:mod:`pagedinfer.adapters.sampling.table`) together with host-side flags
saying which passes any row needs; nothing here reads a device value on the host. Per-request logits
processing (allowed ids, logit bias, ``min_tokens``, penalties, ``min_p``:
:mod:`pagedinfer.adapters.sampling.logits_processors`) arrives as a ``ProcessingStep`` for the rows
that use it, or ``None``: then none of it runs.

Order (vLLM v1's): masks, bias and penalties on the raw logits; greedy rows take the argmax of
those; sampled rows are divided by their temperature, then ``min_p``, top-k and top-p filter,
then the race draws.

On CUDA, a step with none of that processing and no top-k or top-p row (temperature only, the
common case; :func:`uses_fused_race` says when) samples in one fused pass over the logits
instead (:mod:`pagedinfer.adapters.kernels.race_sample`: the race in its log form, two
launches, no probabilities or noise tensor). Its seeded rows use the same noise as here; its
unseeded rows take hash noise keyed by a per-step value drawn from the sampler's own
``random.Random(seed)`` rather than uniforms from its ``torch.Generator``.
"""

from __future__ import annotations

import random

import torch

from pagedinfer.adapters.sampling.batch import NO_SEED, SamplingBatch
from pagedinfer.adapters.sampling.logits_processors import LogitsProcessors, ProcessingStep
from pagedinfer.adapters.sampling.noise import exponential_noise
from pagedinfer.domain.sampling import GREEDY_TEMPERATURE_EPSILON

__all__ = ["NO_TOKEN", "Sampler", "filtered_logits", "sampled_from", "uses_fused_race"]

NO_TOKEN = -1
"""The sample of a row whose logits leave no finite allowed token (see :class:`Sampler`)."""

_MASK64 = (1 << 64) - 1


class Sampler:
    """Samples one token per row of ``logits``; greedy rows are exactly argmax.

    A row is greedy when its request's temperature is below ``GREEDY_TEMPERATURE_EPSILON``
    (0 included): the table stores such rows with temperature 0.0.

    A row gets :data:`NO_TOKEN` (-1) instead of a token when its chosen token's processed
    logit is not finite: every token is masked (``-inf``: no allowed token) or the logits hold
    NaN. The sampler never returns a token a mask forbids; the runner reports such rows as
    failed requests.
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        # Noise for rows without a per-request seed.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed & _MASK64)
        # Keys of the fused race's unseeded noise: one host draw per step, no device read.
        self.step_keys = random.Random(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        processors: LogitsProcessors | None = None,
        processing: ProcessingStep | None = None,
    ) -> torch.Tensor:
        """``logits [n, vocab]`` -> token ids ``[n]`` (int64). ``logits`` may be changed in
        place (when ``processing`` applies and they are float32)."""
        if uses_fused_race(logits.device, batch, processing):
            return _no_token_where_not_finite(logits, self.race(logits, batch))
        return self.sample_with_torch_ops(logits, batch, processors, processing)

    def race(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The fused path (CUDA, temperature only; see :func:`uses_fused_race`): two launches.

        Draws this step's key of the unseeded rows' noise from :attr:`step_keys`.
        """
        from pagedinfer.adapters.kernels.race_sample import race_sample

        assert batch.temperatures is not None and batch.seeds is not None
        return race_sample(
            logits,
            batch.temperatures,
            batch.seeds,
            batch.sample_steps,
            step_key=self.step_keys.getrandbits(63),
            greedy_epsilon=GREEDY_TEMPERATURE_EPSILON,
        )

    def sample_with_torch_ops(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        processors: LogitsProcessors | None = None,
        processing: ProcessingStep | None = None,
    ) -> torch.Tensor:
        """The general path (any device, every option): processing, temperature, top-k /
        top-p, then the race in its ratio form with noise from :meth:`_noise`."""
        logits = _processed(logits, processors, processing)
        if batch.all_greedy:
            return _no_token_where_not_finite(logits, logits.argmax(dim=-1))
        is_greedy = _greedy_rows(batch)
        greedy = None if is_greedy is None else logits.argmax(dim=-1)
        scaled = _scaled_and_filtered(logits, batch, is_greedy, processors, processing)
        probs = scaled.softmax(dim=-1)
        noise = self._noise(probs.shape, batch)
        sampled = probs.div_(noise).argmax(dim=-1)
        if greedy is not None:
            assert is_greedy is not None
            sampled = torch.where(is_greedy, greedy, sampled)
        return _no_token_where_not_finite(logits, sampled)

    def _noise(self, shape: torch.Size, batch: SamplingBatch) -> torch.Tensor:
        rows, vocab = int(shape[0]), int(shape[1])
        if not batch.any_seeded:
            return exponential_noise((rows, vocab), generator=self.generator)
        assert batch.seeds is not None and batch.sample_steps is not None
        return exponential_noise(
            (rows, vocab),
            generator=self.generator,
            seeds=batch.seeds,
            steps=batch.sample_steps,
            seeded=batch.seeds != NO_SEED,
        )


def _no_token_where_not_finite(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` with :data:`NO_TOKEN` where the chosen token's (processed) logit is not
    finite: a fully masked row, or NaN. O(rows): a gather, no pass over the vocabulary."""
    chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return torch.where(torch.isfinite(chosen), tokens, NO_TOKEN)


def filtered_logits(
    logits: torch.Tensor,
    batch: SamplingBatch,
    processors: LogitsProcessors | None = None,
    processing: ProcessingStep | None = None,
) -> torch.Tensor:
    """The float32 logits ``[n, vocab]`` whose softmax the general path's race draws from:
    processed, divided by the temperature, then filtered by ``min_p``, top-k and top-p, with
    ``-inf`` at every token a sampled row can never draw. A greedy row's values do not matter
    (its token is the argmax of the processed logits): it is divided by 1, never filtered by
    top-k, and may be by ``min_p`` or top-p. ``logits`` may be changed in place.

    What :meth:`Sampler.sample_with_torch_ops` computes before its race (tests compare it
    with references written from the definitions).
    """
    logits = _processed(logits, processors, processing)
    if batch.all_greedy:
        return logits.float()
    return _scaled_and_filtered(logits, batch, _greedy_rows(batch), processors, processing)


def sampled_from(
    logits: torch.Tensor,
    batch: SamplingBatch,
    processors: LogitsProcessors | None = None,
    processing: ProcessingStep | None = None,
) -> torch.Tensor:
    """The float32 logits ``[n, vocab]`` each row's token is chosen from, in a new tensor
    (``logits`` unchanged): a sampled row's are :func:`filtered_logits`'s; a greedy row's the
    processed logits, with no temperature and no filter (its token is their argmax)."""
    processed = _processed(logits.to(torch.float32, copy=True), processors, processing)
    if batch.all_greedy:
        return processed
    is_greedy = _greedy_rows(batch)
    scaled = _scaled_and_filtered(processed, batch, is_greedy, processors, processing)
    return scaled if is_greedy is None else torch.where(is_greedy.unsqueeze(1), processed, scaled)


def _processed(
    logits: torch.Tensor, processors: LogitsProcessors | None, processing: ProcessingStep | None
) -> torch.Tensor:
    """Allowed ids, bias, the ``min_tokens`` mask and penalties (in place on float32)."""
    if processing is None:
        return logits
    assert processors is not None
    logits = logits.float()
    processors.apply(logits, processing)
    return logits


def _greedy_rows(batch: SamplingBatch) -> torch.Tensor | None:
    """Which rows are greedy (bool ``[n]``), or ``None`` when the batch has none."""
    if not batch.any_greedy:
        return None
    assert batch.temperatures is not None
    # The table stores greedy rows as 0.0; comparing with the epsilon also keeps a batch built
    # elsewhere from dividing by a tiny temperature (inf, then NaN).
    return batch.temperatures < GREEDY_TEMPERATURE_EPSILON


def _scaled_and_filtered(
    logits: torch.Tensor,
    batch: SamplingBatch,
    is_greedy: torch.Tensor | None,
    processors: LogitsProcessors | None,
    processing: ProcessingStep | None,
) -> torch.Tensor:
    """Temperature, then ``min_p``, top-k and top-p (vLLM's order); greedy rows are divided
    by 1 and left unfiltered by top-k."""
    temperatures = batch.temperatures
    assert temperatures is not None
    if is_greedy is not None:
        temperatures = temperatures.masked_fill(is_greedy, 1.0)
    scaled = logits.float() / temperatures.unsqueeze(1)
    if processing is not None and processing.any_min_p:
        assert processors is not None
        processors.apply_min_p(scaled, processing)
    if batch.any_top_k or batch.any_top_p:
        scaled = _filter_top_k_top_p(scaled, batch, is_greedy)
    return scaled


def uses_fused_race(
    device: torch.device, batch: SamplingBatch, processing: ProcessingStep | None
) -> bool:
    """Whether a step samples with the fused race kernel: on CUDA, with some sampled row, no
    logits processing and no top-k or top-p row. Everything else runs the torch ops (an
    all-greedy step is one ``argmax``)."""
    return (
        device.type == "cuda"
        and processing is None
        and not batch.all_greedy
        and not batch.any_top_k
        and not batch.any_top_p
    )


def _filter_top_k_top_p(
    logits: torch.Tensor, batch: SamplingBatch, is_greedy: torch.Tensor | None
) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    ``is_greedy [n]`` (``None``: no greedy row) marks rows whose sample is discarded: they
    are filtered by nothing, whatever their ``top_k`` column holds. Ties with the k-th
    largest logit are all kept; top-p keeps the smallest set of most likely tokens whose
    mass (renormalised after top-k) reaches ``top_p``, and always the most likely token.
    """
    vocab = logits.shape[-1]
    assert batch.top_ks is not None and batch.top_ps is not None
    ks, top_k_on = _row_top_ks(batch.top_ks, vocab, is_greedy)
    if not batch.any_top_p:
        # top-k only: the k-th largest value is a threshold; no full sort needed. The host
        # bounds the k of every row that has one, so topk needs no device read. A row whose
        # k exceeds that bound (only a batch built with a wrong bound has one) keeps the
        # bound's tokens rather than failing the step; a row without top-k keeps them all.
        width = min(batch.max_top_k or vocab, vocab)
        top_values = logits.topk(width, dim=-1).values
        threshold = top_values.gather(1, (ks.clamp(max=width) - 1).unsqueeze(1))
        threshold.masked_fill_(~top_k_on.unsqueeze(1), float("-inf"))
        return logits.masked_fill_(logits < threshold, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if batch.any_top_k:
        # A row without top-k has k = vocab: its threshold is its smallest logit.
        threshold = sorted_logits.gather(1, (vocab - ks).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < threshold, float("-inf"))
    # Ascending order: drop tokens while the mass at or below them stays <= 1 - top_p, i.e.
    # keep the smallest high-probability set whose mass reaches top_p; always keep the top one.
    cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    drop = cumulative <= (1.0 - batch.top_ps).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    # Back to vocabulary order: the sorted value at position j belongs to token order[j].
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _row_top_ks(
    top_ks: torch.Tensor, vocab: int, is_greedy: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k in ``[1, vocab]`` and whether its top-k filter is on: off for greedy
    rows, for ``top_k`` 0 and for ``top_k >= vocab`` (which keeps every token); an off row
    has k = vocab."""
    on = (top_ks > 0) & (top_ks < vocab)
    if is_greedy is not None:
        on &= ~is_greedy
    return torch.where(on, top_ks, vocab), on
