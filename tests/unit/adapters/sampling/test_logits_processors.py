"""LogitsProcessors: logit_bias, allowed_token_ids, min_tokens, min_p (vs transformers'
MinPLogitsWarper), row bookkeeping, and nothing at all for requests that use none of them."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from transformers import MinPLogitsWarper

from pagedinfer.adapters.sampling.batch import SamplingBatch
from pagedinfer.adapters.sampling.logits_processors import LogitsProcessors, ProcessingStep
from pagedinfer.adapters.sampling.sampler import Sampler
from pagedinfer.domain import SamplingParams
from pagedinfer.domain.plan import NewRequest

CPU = torch.device("cpu")


def after(steps: list[int]) -> Callable[[int], int]:
    """Sample positions for rows whose requests generated ``steps[i]`` tokens (requests added
    without a prompt: ``num_prompt_tokens == 0``; only ``min_tokens`` rows are asked)."""
    return lambda row: steps[row] - 1


EOS = 2


def processed(
    processors: LogitsProcessors, logits: torch.Tensor, keys: list[int], steps: list[int]
) -> torch.Tensor:
    out = logits.clone()
    step = processors.plan(keys, after(steps))
    if step is not None:
        processors.apply(out, step)
    return out


def plan(processors: LogitsProcessors, keys: list[int], steps: list[int]) -> ProcessingStep:
    step = processors.plan(keys, after(steps))
    assert step is not None
    return step


def test_requests_without_features_cost_nothing() -> None:
    processors = LogitsProcessors(100, CPU, [EOS])
    plain = [SamplingParams(), SamplingParams(temperature=0.0, top_k=5, logprobs=3, n=2)]
    assert not any(processors.add(key, params) for key, params in enumerate(plain))
    assert len(processors) == 0
    assert processors.plan([0, 1], after([0, 0])) is None
    # No vocabulary-sized table exists until a request needs one.
    assert processors._bias is None and processors._output_counts is None
    processors.add(2, SamplingParams(min_p=0.1))
    assert processors._bias is None and processors._output_counts is None
    assert processors.plan([0, 1], after([0, 0])) is None  # request 2 is not in this step


def test_logit_bias_and_allowed_token_ids() -> None:
    vocab = 10
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    processors = LogitsProcessors(vocab, CPU, [EOS])
    processors.add(7, SamplingParams(logit_bias={1: 5.0, 4: -3.5}))
    processors.add(8, SamplingParams(allowed_token_ids=[3, 6], logit_bias={6: 1.0, 9: 2.0}))
    # Row 1 is a request without processing, between two that have some.
    out = processed(processors, logits, [7, 99, 8], [0, 0, 0])
    expected = logits.clone()
    expected[0, 1] += 5.0
    expected[0, 4] -= 3.5
    expected[2] = -math.inf
    expected[2, 3] = logits[2, 3]
    expected[2, 6] = logits[2, 6] + 1.0
    torch.testing.assert_close(out, expected)


def test_only_allowed_tokens_are_sampled() -> None:
    vocab, n = 50, 400
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1))
    processors = LogitsProcessors(vocab, CPU)
    params = SamplingParams(allowed_token_ids=[5, 17, 33])
    for key in range(n):
        processors.add(key, params)
    step = plan(processors, list(range(n)), [0] * n)
    processors.apply(logits, step)
    sampling = SamplingBatch(
        all_greedy=False,
        temperatures=torch.ones(n),
        top_ks=torch.zeros(n, dtype=torch.int64),
        top_ps=torch.ones(n),
    )
    assert set(Sampler(CPU)(logits, sampling).tolist()) == {5, 17, 33}


def test_min_tokens_holds_back_eos_and_stop_tokens_until_reached() -> None:
    vocab = 8
    logits = torch.zeros(4, vocab)
    processors = LogitsProcessors(vocab, CPU, [EOS])
    processors.add(0, SamplingParams(min_tokens=3, stop_token_ids=[5, 6]))
    processors.add(1, SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[5]))
    processors.add(2, SamplingParams(min_tokens=1))
    masked = [
        (processed(processors, logits, [0, 1, 2], [step] * 3) == -math.inf).nonzero().tolist()
        for step in range(4)
    ]
    assert masked[0] == [[0, EOS], [0, 5], [0, 6], [1, 5], [2, EOS]]
    assert masked[1] == masked[2] == [[0, EOS], [0, 5], [0, 6], [1, 5]]
    assert masked[3] == []
    # min_tokens with nothing to hold back needs no processing at all.
    assert not LogitsProcessors(vocab, CPU, []).add(0, SamplingParams(min_tokens=3))


@pytest.mark.parametrize(("rows", "vocab"), [(1, 32), (6, 500)])
def test_min_p_matches_transformers(rows: int, vocab: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    processors = LogitsProcessors(vocab, CPU)
    values = [0.05, 0.0, 0.3, 0.9, 1.0, 0.5][:rows]
    for key, min_p in enumerate(values):
        processors.add(key, SamplingParams(min_p=min_p, presence_penalty=0.1 if key % 2 else 0.0))
    step = plan(processors, list(range(rows)), [0] * rows)
    out = logits.clone()
    processors.apply_min_p(out, step)
    for row, min_p in enumerate(values):
        expected = logits[row : row + 1].clone()
        if min_p > 0:
            expected = MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.int64), expected)
        assert torch.equal(out[row : row + 1].isinf(), expected.isinf()), (row, min_p)
        assert out[row].isfinite().any()  # the top token always survives


def test_rows_are_reused_and_tables_grow_without_losing_state() -> None:
    vocab = 6
    processors = LogitsProcessors(vocab, CPU, initial_rows=1)
    processors.add(0, SamplingParams(logit_bias={1: 1.0}))
    processors.add(1, SamplingParams(repetition_penalty=2.0), prompt_token_ids=[3])
    processors.add(2, SamplingParams(logit_bias={4: -1.0}))
    assert processors.capacity == 4 and len(processors) == 3
    logits = torch.ones(3, vocab)
    out = processed(processors, logits, [2, 1, 0], [0, 0, 0])
    assert out.tolist() == [
        [1, 1, 1, 1, 0, 1],
        [1, 1, 1, 0.5, 1, 1],
        [1, 2, 1, 1, 1, 1],
    ]
    # A removed request's row is reused by the next one, with none of the old state.
    processors.remove(1)
    processors.remove(12345)  # unknown keys are ignored
    processors.add(3, SamplingParams(repetition_penalty=2.0), prompt_token_ids=[5])
    assert processors.capacity == 4 and len(processors) == 3
    assert processed(processors, logits[:1], [3], [0]).tolist() == [[1, 1, 1, 1, 1, 0.5]]


def test_integer_biases_are_added_as_floats() -> None:
    """JSON clients send ``{"50256": -100}``: integer biases, as the API allows."""
    processors = LogitsProcessors(6, CPU)
    processors.add(0, SamplingParams(logit_bias={1: 3, 4: -100}))
    processors.add(1, SamplingParams(allowed_token_ids=[0, 2], logit_bias={2: 1}))
    out = processed(processors, torch.zeros(2, 6), [0, 1], [0, 0])
    inf = math.inf
    assert out.tolist() == [[0, 3, 0, 0, -100, 0], [0, -inf, 1, -inf, -inf, -inf]]


def test_every_table_and_index_stays_on_the_processors_device() -> None:
    """On the meta device (shapes only), standing in for CUDA: a table, an index or a source
    tensor created on the host instead of ``device`` fails the op that mixes them. Every
    feature, a table that grows, and a step with an unprocessed row."""
    meta = torch.device("meta")
    vocab = 16
    processors = LogitsProcessors(vocab, meta, [EOS], initial_rows=1)
    processors.add(0, SamplingParams(logit_bias={3: 1.0}, allowed_token_ids=[1, 3], min_p=0.1))
    processors.add(
        1, SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, min_tokens=4), [1, 2], [4]
    )
    processors.add(2, SamplingParams(frequency_penalty=0.5, logit_bias={5: -1.0}), [7], [8, 8])
    assert processors.capacity == 4
    step = processors.plan([0, 9, 1, 2], lambda row: 1)
    assert step is not None and step.held_back is not None and step.batch_rows is not None
    for tensor in (step.batch_rows, step.table_rows, *step.held_back):
        assert tensor.device == meta
    logits = torch.empty(4, vocab, device=meta)
    processors.apply(logits, step)
    processors.apply_min_p(logits, step)
    processors.record(step, torch.zeros(4, dtype=torch.int64, device=meta))
    every = processors.plan([2, 1, 0], lambda row: 9)
    assert every is not None and every.batch_rows is None
    processors.apply(logits[:3], every)
    assert logits.device == meta


def test_install_takes_the_plans_prompt_length_and_replaces_the_slots_request() -> None:
    vocab = 8
    processors = LogitsProcessors(vocab, CPU, [EOS])
    # min_tokens without a repetition penalty: the plan sends the prompt's length, no tokens.
    processors.install(
        NewRequest(seq_id=1, slot=3, params=SamplingParams(min_tokens=2), num_prompt_tokens=5)
    )
    held = processors.plan([7, 3], lambda row: 5)  # 1 token generated before this one
    assert held is not None and held.held_back is not None
    assert [pair.tolist() for pair in held.held_back] == [[0], [EOS]]
    free = processors.plan([7, 3], lambda row: 6)  # 2 generated: min_tokens reached
    assert free is not None and free.held_back is None
    # The slot's next request replaces it, with its prompt for the repetition penalty.
    params = SamplingParams(repetition_penalty=2.0)
    processors.install(
        NewRequest(seq_id=2, slot=3, params=params, num_prompt_tokens=2, prompt_token_ids=(4, 6))
    )
    assert len(processors) == 1
    out = processed(processors, torch.ones(1, vocab), [3], [0])
    assert out.tolist() == [[1, 1, 1, 1, 0.5, 1, 0.5, 1]]


def test_freed_rows_of_a_grown_table_are_all_used_before_it_grows_again() -> None:
    vocab = 4
    processors = LogitsProcessors(vocab, CPU, initial_rows=1)
    params = SamplingParams(logit_bias={1: 1.0}, repetition_penalty=1.5)
    for key in range(4):
        processors.add(key, params, prompt_token_ids=[2])
    assert processors.capacity == 4  # 1, 2, then 4 rows: every new row was handed out
    for table in (processors._scalars, processors._bias, processors._prompt_mask):
        assert table is not None and table.shape[0] == processors.capacity
