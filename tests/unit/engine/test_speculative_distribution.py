"""Speculative decoding keeps sampled (unseeded) requests on the target distribution.

The exactness tests (test_speculative.py) cover greedy and seeded requests token by token;
this one covers what they cannot: unseeded sampling, where only the distribution is promised.
A 16-token random model makes each token's probabilities large enough to count. Every
completion of a fixed prompt samples ``t1`` in the prefill step; a fixed proposer then drafts
one token after it, so the next step is a verify row that yields ``t2`` (the accepted draft or
the sample that rejected it) and, when the draft is accepted, the bonus token ``t3``. The
exact target probabilities ``p(t2 | t1)`` and ``p(t3 | t1, t2)`` come from the model itself
(the logprobs of an engine without speculation, over the whole vocabulary), filtered by
top-k / top-p as the sampler does. A chi-square test over the counts of ``t2`` given ``t1``
and of ``t3`` given ``(t1, t2)`` must not reject at p = 0.001, for a GOOD proposer (the most
likely token: often accepted), a BAD one (the least likely: almost always rejected), with
top-k / top-p, and for the draft-model proposer (the target as its own draft, and a smaller
random draft); and the number of accepted drafts must match the probability the target gives
them (a rule that never accepts keeps the distribution but fails that).

Breaking ``accepted_length`` by hand makes these tests fail: accepting every draft (all five
cases), accepting when the sample is the draft or its neighbouring token id (four: the fifth's
neighbours are outside its top-k) and never accepting (all five, by the acceptance count).
The engine's seed is fixed, so the unseeded draws, and the outcome, are reproducible.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from pagedinfer import Engine, SamplingParams

VOCAB = 16
PROMPT = [1, 2, 3, 4, 5]
N = 128  # completions per request (forks of one prompt)
REQUESTS = 32  # 4096 completions per case (fixed proposers)
DRAFT_REQUESTS = 2048  # draft-model cases: separate requests, slower per token
P_VALUE = 0.001
OPTIONS = {
    "device": "cpu",
    "kv_block_size": 4,
    "max_model_len": 32,
    "max_num_seqs": 256,
    "max_logprobs": VOCAB,
    "num_threads": 1,
    "seed": 1234,
}

Distribution = list[float]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    # A wider initializer than the preset's: peaked distributions (top token 0.2 to 0.5).
    return make_checkpoint("tiny", vocab_size=VOCAB, initializer_range=0.2)


@pytest.fixture(scope="module")
def plain(checkpoint: Path) -> Iterator[Engine]:
    with Engine(checkpoint, **OPTIONS) as engine:  # type: ignore[arg-type]
        yield engine


@pytest.fixture(scope="module")
def speculative(checkpoint: Path) -> Iterator[Engine]:
    spec = {"method": "ngram", "num_speculative_tokens": 1}
    with Engine(checkpoint, speculative_config=spec, **OPTIONS) as engine:  # type: ignore[arg-type]
        yield engine


class _TargetModel:
    """The model's next-token probabilities after any prefix (raw logprobs over the whole
    vocabulary from an engine without speculation), cached."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cache: dict[tuple[int, ...], Distribution] = {}

    def fetch(self, prefixes: Sequence[tuple[int, ...]]) -> None:
        missing = [prefix for prefix in dict.fromkeys(prefixes) if prefix not in self.cache]
        if not missing:
            return
        params = SamplingParams(max_tokens=1, logprobs=VOCAB, temperature=0.0)
        outputs = self.engine.generate([list(p) for p in missing], params, use_tqdm=False)
        for prefix, output in zip(missing, outputs, strict=True):
            entries = output.outputs[0].logprobs
            assert entries is not None
            logprobs = entries[0]
            assert len(logprobs) == VOCAB
            self.cache[prefix] = [math.exp(logprobs[token].logprob) for token in range(VOCAB)]

    def __call__(self, prefix: tuple[int, ...]) -> Distribution:
        return self.cache[prefix]


def _filtered(probs: Distribution, top_k: int, top_p: float) -> Distribution:
    """The sampler's top-k (ties with the k-th kept), then top-p on the renormalised rest
    (the smallest most likely set whose mass reaches top_p), at temperature 1."""
    kept = list(probs)
    if 0 < top_k < VOCAB:
        threshold = sorted(probs, reverse=True)[top_k - 1]
        kept = [p if p >= threshold else 0.0 for p in kept]
    total = sum(kept)
    kept = [p / total for p in kept]
    if top_p < 1.0:
        order = sorted(range(VOCAB), key=lambda token: kept[token])  # ascending
        mass_below = 0.0
        for index, token in enumerate(order):
            mass_below += kept[token]
            # Boundaries far from top_p: float32 rounding in the sampler cannot flip them.
            assert abs(mass_below - (1.0 - top_p)) > 1e-4, "choose another top_p"
            if mass_below <= 1.0 - top_p and index < VOCAB - 1:
                kept[token] = 0.0
        total = sum(kept)
        kept = [p / total for p in kept]
    return kept


class _FixedProposer:
    """One draft after the first generated token: ``drafts[t1]``; nothing afterwards."""

    def __init__(self, drafts: dict[int, int]) -> None:
        self.drafts = drafts
        self.num_speculative_tokens = 1
        self.method = "ngram"  # proposes on the host, as the n-gram lookup does

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        if len(token_ids) != len(PROMPT) + 1 or max_drafts < 1:
            return []
        return [self.drafts[token_ids[-1]]]


def _chi_square(strata: list[tuple[Counter[int], Distribution]]) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom of counts against multinomials, summed over
    strata; in each stratum, cells expecting fewer than 5 are merged into one (itself merged
    into the smallest other cell if it still expects fewer than 5)."""
    statistic, dof = 0.0, 0
    for counts, probs in strata:
        total = sum(counts.values())
        cells = sorted(range(VOCAB), key=lambda token: probs[token], reverse=True)
        observed = [float(counts[token]) for token in cells]
        expected = [total * probs[token] for token in cells]
        for token in range(VOCAB):
            assert counts[token] == 0 or probs[token] > 0.0, f"token {token} has p = 0"
        while len(expected) > 1 and expected[-1] < 5.0:  # merge the rarest into the next
            rare_expected, rare_observed = expected.pop(), observed.pop()
            expected[-1] += rare_expected
            observed[-1] += rare_observed
        if len(expected) < 2:
            continue
        statistic += sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
        dof += len(expected) - 1
    return statistic, dof


def _p_value(statistic: float, dof: int) -> float:
    """The chi-square distribution's upper tail: Q(dof / 2, statistic / 2)."""
    a = torch.tensor(dof / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(statistic / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize(
    ("proposer", "top_k", "top_p"),
    [("good", 0, 1.0), ("bad", 0, 1.0), ("good", 6, 0.83)],
)
def test_sampled_speculation_draws_from_the_target(
    plain: Engine, speculative: Engine, proposer: str, top_k: int, top_p: float
) -> None:
    target = _TargetModel(plain)
    target.fetch([(*PROMPT, t1) for t1 in range(VOCAB)])
    pick = max if proposer == "good" else min
    drafts = {
        t1: pick(range(VOCAB), key=lambda t, t1=t1: target((*PROMPT, t1))[t])  # type: ignore[misc]
        for t1 in range(VOCAB)
    }
    speculative.speculation = _FixedProposer(drafts)  # type: ignore[assignment]
    params = SamplingParams(
        temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=3, ignore_eos=True, n=N
    )
    _check(speculative, [PROMPT] * REQUESTS, params, target, drafts, good=proposer == "good")


@pytest.mark.parametrize("draft", ["same", "smaller"])
def test_draft_model_sampling_draws_from_the_target(
    checkpoint: Path, make_checkpoint: Callable[..., Path], plain: Engine, draft: str
) -> None:
    """The draft-model proposer: the target as its own draft (its greedy token: often
    accepted), and a smaller random draft with other weights (mostly rejected). Its drafts
    after each ``t1`` are the draft checkpoint's greedy tokens. Separate requests (``n = 1``):
    a completion forked in a step gets no drafts from that step."""
    draft_path = (
        checkpoint
        if draft == "same"
        else make_checkpoint(
            "tiny", seed=5, vocab_size=VOCAB, initializer_range=0.2, num_hidden_layers=1
        )
    )
    target = _TargetModel(plain)
    target.fetch([(*PROMPT, t1) for t1 in range(VOCAB)])
    with Engine(draft_path, **OPTIONS) as drafting:  # type: ignore[arg-type]
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        outputs = drafting.generate([[*PROMPT, t1] for t1 in range(VOCAB)], greedy, use_tqdm=False)
    drafts = {t1: output.outputs[0].token_ids[0] for t1, output in enumerate(outputs)}
    config = {"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": 1}
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    with Engine(checkpoint, speculative_config=config, **OPTIONS) as engine:  # type: ignore[arg-type]
        _check(engine, [PROMPT] * DRAFT_REQUESTS, params, target, drafts, good=draft == "same")


def _check(
    speculative: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    target: _TargetModel,
    drafts: dict[int, int],
    *,
    good: bool,
) -> None:
    """Run the prompts; chi-square of t2 given t1 and t3 given (t1, t2) against the target,
    and the acceptance count against the drafts' target probabilities."""
    start = tuple(PROMPT)
    top_k, top_p = params.top_k, params.top_p

    def after(*tokens: int) -> Distribution:
        return _filtered(target((*start, *tokens)), top_k, top_p)

    before = speculative.stats()
    outputs = speculative.generate(prompts, params, use_tqdm=False)
    stats = speculative.stats()
    triples = [tuple(completion.token_ids) for output in outputs for completion in output.outputs]
    assert len(triples) == len(prompts) * params.n and all(len(t) == 3 for t in triples)
    # Every completion verified exactly one draft, right after its first token.
    rows = stats.spec_decode_num_drafts - before.spec_decode_num_drafts
    assert rows == len(triples)
    assert stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens == rows
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    target.fetch([(*start, t1, t2) for t1, t2, _ in triples])

    second: dict[int, Counter[int]] = {}
    third: dict[tuple[int, int], Counter[int]] = {}
    for t1, t2, t3 in triples:
        second.setdefault(t1, Counter())[t2] += 1
        third.setdefault((t1, t2), Counter())[t3] += 1
    strata = [(counts, after(t1)) for t1, counts in second.items()]
    strata += [(counts, after(t1, t2)) for (t1, t2), counts in third.items()]
    statistic, dof = _chi_square(strata)
    p_value = _p_value(statistic, dof)
    assert p_value > P_VALUE, f"chi-square {statistic:.1f} on {dof} dof: p = {p_value:.2g}"

    # The drafts are accepted with the probability the target gives them: binomial counts
    # given t1 (mean and variance summed over the strata), within 4.5 standard deviations.
    mean = sum(sum(c.values()) * after(t1)[drafts[t1]] for t1, c in second.items())
    variance = sum(
        sum(c.values()) * after(t1)[drafts[t1]] * (1 - after(t1)[drafts[t1]])
        for t1, c in second.items()
    )
    assert accepted == sum(c[drafts[t1]] for t1, c in second.items())
    assert abs(accepted - mean) <= 4.5 * math.sqrt(variance) + 1, (accepted, mean)
    if good:
        assert accepted > len(triples) // 5, "the good proposer should often be accepted"
