"""Regressions of the sampler in heterogeneous batches (issue 21, item 1).

A step mixes rows whose filters differ: greedy rows (whose ``top_k`` column still holds the
request's value, or 0), sampled rows with top-k off, with a k beyond the vocabulary, with
top-k and top-p together. None of them may make another row's filter fail or change: every
pair of such rows is sampled together here, with the batch built both ways the engine and
the tests build it (:meth:`SamplingTable.rows` and :meth:`SamplingBatch.from_params`), and
once through a real :class:`~pagedinfer.Engine`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hf_reference import hf_model
from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.sampling.batch import SamplingBatch
from pagedinfer.adapters.sampling.sampler import Sampler
from pagedinfer.adapters.sampling.table import SamplingTable

CPU = torch.device("cpu")
VOCAB = 16
ROWS_PER_KIND = 256
# Distinct logits, spread enough that every kept token is drawn among ROWS_PER_KIND rows.
LOGITS = torch.linspace(1.0, 0.0, VOCAB)[
    torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
]
ORDER = LOGITS.argsort(descending=True).tolist()  # tokens from the most to the least likely

KINDS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy top_k=5": SamplingParams(temperature=0.0, top_k=5),
    "greedy top_k>vocab": SamplingParams(temperature=0.0, top_k=99),
    "top_k off": SamplingParams(temperature=1.0),
    "top_k=3": SamplingParams(temperature=1.0, top_k=3),
    "top_k=vocab": SamplingParams(temperature=1.0, top_k=VOCAB),
    "top_k>vocab": SamplingParams(temperature=1.0, top_k=99),
    "top_k=3 top_p=0.5": SamplingParams(temperature=1.0, top_k=3, top_p=0.5),
    "top_p=0.5": SamplingParams(temperature=1.0, top_p=0.5),
    "top_k=1": SamplingParams(temperature=1.0, top_k=1),
}


def kept(params: SamplingParams) -> set[int]:
    """The tokens a row may draw (the filters written out on LOGITS)."""
    if params.is_greedy:
        return {ORDER[0]}
    k = VOCAB if params.top_k == 0 else min(params.top_k, VOCAB)
    candidates = ORDER[:k]
    probs = torch.softmax(LOGITS[candidates].double(), dim=0).tolist()
    keep, mass = [], 0.0
    for token, p in zip(candidates, probs, strict=True):
        keep.append(token)
        mass += p
        if mass >= params.top_p:
            break
    return set(keep)


@dataclass(frozen=True)
class _New:
    seq_id: int
    slot: int
    params: SamplingParams
    num_prompt_tokens: int = 1
    prompt_token_ids: tuple[int, ...] = (0,)


def from_table(params: list[SamplingParams]) -> SamplingBatch:
    table = SamplingTable(len(params), vocab_size=VOCAB, device=CPU)
    delta = table.apply((), [_New(i, i, p) for i, p in enumerate(params)])
    assert delta is not None
    table.write_rows(
        torch.frombuffer(delta.slots, dtype=torch.int64),
        torch.frombuffer(delta.floats, dtype=torch.float32),
        torch.frombuffer(delta.ints, dtype=torch.int64),
    )
    return table.rows(torch.arange(len(params), dtype=torch.int32), None)


def from_params(params: list[SamplingParams]) -> SamplingBatch:
    return SamplingBatch.from_params(params, CPU, vocab_size=VOCAB)


BUILDERS: dict[str, Callable[[list[SamplingParams]], SamplingBatch]] = {
    "table": from_table,
    "from_params": from_params,
}


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_every_pair_of_row_kinds_samples_together(builder: str) -> None:
    """Each row draws exactly its own kept set, whatever the other rows of the step are."""
    build = BUILDERS[builder]
    failures = []
    for first, second in itertools.combinations_with_replacement(KINDS, 2):
        params = [KINDS[first]] * ROWS_PER_KIND + [KINDS[second]] * ROWS_PER_KIND
        logits = LOGITS.expand(len(params), -1).contiguous()
        tokens = Sampler(CPU, seed=1)(logits, build(params))
        for name, drawn in ((first, tokens[:ROWS_PER_KIND]), (second, tokens[ROWS_PER_KIND:])):
            if set(drawn.tolist()) != kept(KINDS[name]):
                failures.append((first, second, name, sorted(set(drawn.tolist()))))
    assert not failures


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_the_host_bound_on_k_counts_only_rows_with_top_k(builder: str) -> None:
    """``max_top_k`` bounds the k of sampled rows with top-k on: a greedy row's k (its
    request's ``top_k``, or 0) neither raises it nor is bounded by it, and a row with top-k
    off does not widen the step's ``topk`` to the vocabulary."""
    params = [KINDS["greedy top_k=5"], KINDS["greedy"], KINDS["top_k off"], KINDS["top_k=3"]]
    batch = BUILDERS[builder](params)
    assert batch.any_top_k and batch.any_greedy
    assert batch.max_top_k == 3


def test_a_row_whose_k_exceeds_the_host_bound_keeps_the_bound() -> None:
    """A batch whose ``max_top_k`` understates a row's k (a caller's mistake) must not fail
    the step: that row keeps its top ``max_top_k`` tokens."""
    batch = SamplingBatch.from_params([KINDS["top_k=3"]] * 400, CPU, vocab_size=VOCAB)
    understated = SamplingBatch(
        all_greedy=False,
        any_top_k=True,
        max_top_k=2,
        temperatures=batch.temperatures,
        top_ks=batch.top_ks,
        top_ps=batch.top_ps,
        seeds=batch.seeds,
    )
    tokens = Sampler(CPU)(LOGITS.expand(400, -1).contiguous(), understated)
    assert set(tokens.tolist()) == set(ORDER[:2])


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Iterator[Engine]:
    with Engine(
        tiny_checkpoint,
        device="cpu",
        dtype="float32",
        max_model_len=64,
        kv_block_size=16,
        num_kv_blocks=160,
    ) as engine:
        yield engine


def test_a_greedy_and_a_top_k_request_run_in_one_engine_step(
    engine: Engine, tiny_checkpoint: Path
) -> None:
    """Issue 21 item 1: this pair failed every step with ``index 511 is out of bounds``."""
    prompts = [[1, 2, 3], [4, 5, 6]]
    outputs = engine.generate(
        prompts,
        [
            SamplingParams(temperature=0, max_tokens=4),
            SamplingParams(temperature=1, top_k=20, max_tokens=1, n=64),
        ],
        use_tqdm=False,
    )
    alone = engine.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    with torch.inference_mode():
        logits = hf_model(str(tiny_checkpoint))(torch.tensor([prompts[1]])).logits[0, -1]
    top_20 = set(logits.topk(20).indices.tolist())
    drawn = {completion.token_ids[0] for completion in outputs[1].outputs}
    assert drawn <= top_20 and len(drawn) > 5
