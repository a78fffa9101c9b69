"""The sampler's filters against a plain NumPy reference written from the definitions.

The reference (``sampling_reference.py``) follows vLLM's semantics and order: temperature,
then ``min_p``, top-k (ties with the k-th kept) and top-p (the smallest set of most likely
tokens whose renormalised mass reaches ``top_p``, at least one). Greedy rows (temperature 0)
take the argmax whatever their filters say.

Assumptions of the reference, so that float32 rounding cannot decide a case: probabilities are
distinct (which of two tokens tied at the top-p boundary is kept is not specified; ties at
the top-k threshold are tested separately), and no ``min_p`` or ``top_p`` boundary lies within
``MARGIN`` of a token's probability or a prefix's mass. The probability vectors are shuffled
(never sorted), so a filter that confuses a permutation with its inverse fails.

Two checks per drawn batch: the ``-inf`` mask of :func:`~pagedinfer.adapters.sampling.sampler.
filtered_logits` is exactly the complement of the reference's kept set (and the kept logits
are the tempered ones), and sampling each row many times draws only kept tokens and every
kept token of probability at least 0.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from pagedinfer.adapters.sampling.batch import SamplingBatch
from pagedinfer.adapters.sampling.logits_processors import LogitsProcessors, ProcessingStep
from pagedinfer.adapters.sampling.sampler import Sampler, filtered_logits
from pagedinfer.adapters.sampling.table import SamplingTable
from pagedinfer.domain.sampling import SamplingParams

from .sampling_reference import kept_tokens, near_a_boundary

CPU = torch.device("cpu")
MARGIN = 1e-4
DRAWS = 400  # per row: a kept token of probability >= 0.1 is missed with chance 0.9**400
MASK_SETTINGS = settings(max_examples=300, deadline=None)
SAMPLING_SETTINGS = settings(max_examples=60, deadline=None)


def reference_kept(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The tokens a sampled row may draw (bool ``[vocab]``), from the definitions."""
    return kept_tokens(logits, params)


@dataclass(frozen=True)
class Case:
    logits: torch.Tensor  # [rows, vocab] float32, rows in the order of params
    params: list[SamplingParams]
    table: bool  # build the batch with the SamplingTable (else SamplingBatch.from_params)


@st.composite
def row_params(draw: st.DrawFn, vocab: int, top_p_off: bool) -> SamplingParams:
    """One row's filters, often at their edges (off, k at and beyond the vocabulary)."""
    greedy = draw(st.integers(0, 3)) == 0
    top_p = 1.0 if top_p_off or draw(st.integers(0, 2)) == 0 else draw(st.floats(0.02, 0.99))
    return SamplingParams(
        temperature=0.0 if greedy else draw(st.sampled_from([0.3, 0.7, 1.0, 1.6, 3.0])),
        min_p=0.0 if draw(st.integers(0, 2)) == 0 else draw(st.floats(0.01, 0.9)),
        top_k=draw(st.sampled_from([0, -1, vocab, vocab + 1, 1000]) | st.integers(1, vocab)),
        top_p=top_p,
    )


@st.composite
def cases(draw: st.DrawFn) -> Case:
    vocab = draw(st.integers(2, 12))
    num_rows = draw(st.integers(1, 5))
    # Without any top-p row the sampler takes its top-k-only path (no sort).
    top_p_off = draw(st.booleans())
    rows, params = [], []
    for _ in range(num_rows):
        weights = draw(st.lists(st.integers(1, 5000), min_size=vocab, max_size=vocab, unique=True))
        shuffled = draw(st.permutations(weights))
        probs = np.asarray(shuffled, dtype=np.float64) / sum(shuffled)
        row = np.log(probs).astype(np.float32)
        p = draw(row_params(vocab, top_p_off))
        if not p.is_greedy and near_a_boundary(row, p, MARGIN):
            p = SamplingParams(temperature=p.temperature)  # only the temperature: no boundary
        rows.append(row)
        params.append(p)
    return Case(torch.from_numpy(np.stack(rows)), params, draw(st.booleans()))


@dataclass(frozen=True)
class _New:
    seq_id: int
    slot: int
    params: SamplingParams
    num_prompt_tokens: int = 1
    prompt_token_ids: tuple[int, ...] = (0,)


def build(
    case: Case, repeat: int = 1
) -> tuple[torch.Tensor, SamplingBatch, LogitsProcessors, ProcessingStep | None]:
    """The case's logits, batch and processing with every row repeated ``repeat`` times."""
    vocab = case.logits.shape[1]
    keys = [row for row in range(len(case.params)) for _ in range(repeat)]
    params = [case.params[key] for key in keys]
    if case.table:
        table = SamplingTable(len(case.params), vocab_size=vocab, device=CPU)
        delta = table.apply((), [_New(i, i, p) for i, p in enumerate(case.params)])
        assert delta is not None
        table.write_rows(
            torch.frombuffer(delta.slots, dtype=torch.int64),
            torch.frombuffer(delta.floats, dtype=torch.float32),
            torch.frombuffer(delta.ints, dtype=torch.int64),
        )
        batch = table.rows(torch.tensor(keys, dtype=torch.int32), None)
    else:
        batch = SamplingBatch.from_params(params, CPU, vocab_size=vocab)
    processors = LogitsProcessors(vocab, CPU)
    for key, p in enumerate(case.params):
        processors.add(key, p)
    processing = processors.plan(keys, lambda _: 0)
    return case.logits[keys].contiguous(), batch, processors, processing


@MASK_SETTINGS
@given(cases())
def test_the_filtered_logits_mask_exactly_what_the_reference_drops(case: Case) -> None:
    logits, batch, processors, processing = build(case)
    filtered = filtered_logits(logits.clone(), batch, processors, processing)
    assert not torch.isnan(filtered).any()
    for row, params in enumerate(case.params):
        if params.is_greedy:
            continue
        kept = torch.from_numpy(reference_kept(case.logits[row].numpy(), params))
        assert torch.equal(torch.isfinite(filtered[row]), kept), (row, params)
        tempered = logits[row] / params.temperature
        assert torch.allclose(filtered[row][kept], tempered[kept]), (row, params)


@SAMPLING_SETTINGS
@given(cases())
def test_sampling_draws_exactly_from_the_reference_kept_set(case: Case) -> None:
    logits, batch, processors, processing = build(case, repeat=DRAWS)
    tokens = Sampler(CPU, seed=7)(logits.clone(), batch, processors, processing)
    for row, params in enumerate(case.params):
        drawn = set(tokens[row * DRAWS : (row + 1) * DRAWS].tolist())
        values = case.logits[row]
        if params.is_greedy:
            assert drawn == {int(values.argmax())}, (row, params)
            continue
        kept = reference_kept(values.numpy(), params)
        assert drawn <= set(np.flatnonzero(kept).tolist()), (row, params, sorted(drawn))
        z = np.where(kept, values.numpy().astype(np.float64) / params.temperature, -np.inf)
        q = np.exp(z - z.max())
        q /= q.sum()
        likely = set(np.flatnonzero(q >= 0.1).tolist())
        assert likely <= drawn, (row, params, sorted(drawn))


def probs_logits(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).contiguous()


def test_top_p_on_an_unsorted_vector_keeps_the_most_likely_tokens() -> None:
    """[0.1, 0.6, 0.05, 0.25] with top_p 0.5 keeps token 1 (the un-sort after top-p must
    invert the sort: a gather by the sort order keeps token 2 instead)."""
    params = [SamplingParams(top_p=0.5), SamplingParams(top_p=0.8)]
    batch = SamplingBatch.from_params(params, CPU, vocab_size=4)
    filtered = filtered_logits(probs_logits([0.1, 0.6, 0.05, 0.25], rows=2), batch)
    assert torch.isfinite(filtered).tolist() == [
        [False, True, False, False],
        [False, True, False, True],
    ]


@pytest.mark.parametrize("top_k", [3, 4, 5, 1000])
@pytest.mark.parametrize("top_p", [1.0, 0.99])
def test_top_k_at_or_above_the_vocabulary_keeps_every_token(top_k: int, top_p: float) -> None:
    """k >= vocab is top-k off, alone and with top-p, next to a row with a small k."""
    probs = [0.1, 0.5, 0.15, 0.25]
    params = [SamplingParams(top_k=top_k, top_p=top_p), SamplingParams(top_k=2)]
    batch = SamplingBatch.from_params(params, CPU, vocab_size=4)
    filtered = filtered_logits(probs_logits(probs, rows=2), batch)
    kept = torch.isfinite(filtered).tolist()
    assert kept[0] == ([True] * 4 if top_k >= len(probs) else [False, True, True, True])
    assert kept[1] == [False, True, False, True]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_tokens_tied_with_the_kth_are_all_kept(top_p: float) -> None:
    """The k-th largest logit is a threshold: a tie with it keeps every tied token."""
    params = [SamplingParams(top_k=1, top_p=top_p), SamplingParams(top_k=3, top_p=top_p)]
    batch = SamplingBatch.from_params(params, CPU, vocab_size=5)
    filtered = filtered_logits(probs_logits([0.1, 0.3, 0.3, 0.2, 0.1], rows=2), batch)
    assert torch.isfinite(filtered[0]).tolist() == [False, True, True, False, False]
    assert torch.isfinite(filtered[1, [1, 2, 3]]).all()


def test_top_p_renormalises_over_what_min_p_kept() -> None:
    """min_p comes first: of [0.4, 0.3, 0.2, 0.1], min_p 0.6 keeps {0, 1} (0.571 / 0.429
    renormalised), so top_p 0.5 keeps token 0 alone; top-p first would keep {0, 1}."""
    case = Case(probs_logits([0.4, 0.3, 0.2, 0.1]), [SamplingParams(min_p=0.6, top_p=0.5)], False)
    logits, batch, processors, processing = build(case)
    filtered = filtered_logits(logits, batch, processors, processing)
    assert torch.isfinite(filtered[0]).tolist() == [True, False, False, False]
