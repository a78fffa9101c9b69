"""``batch_invariant=True``: a request's tokens and logprobs are bitwise the same alone and in
a batch of others (different lengths, prompts prefilled in chunks beside decoding rows), on
the CPU in float32 (issue 40; adapters/batch_invariant.py). Without the flag the logprobs of
this workload differ in their last bits on the CPU (docs/sleep_mode.md)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedinfer import Engine, RequestOutput, SamplingParams
from pagedinfer.adapters.batch_invariant import ROW_TILE, attend_group, tiled_linear

VOCAB = 512  # the tiny checkpoint's
_rng = random.Random(40)
TARGET = [_rng.randrange(VOCAB) for _ in range(37)]
OTHERS = [[_rng.randrange(VOCAB) for _ in range(n)] for n in (5, 60, 13, 90, 3, 41)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=10, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Iterator[Engine]:
    # A token budget of 32: the batch's prompts are prefilled in chunks beside decoding rows.
    with Engine(
        tiny_checkpoint,
        device="cpu",
        dtype="float32",
        kv_block_size=16,
        max_model_len=256,
        max_num_batched_tokens=32,
        batch_invariant=True,
    ) as built:
        yield built


def _logprobs(output: RequestOutput) -> list[float]:
    completion = output.outputs[0]
    assert completion.logprobs is not None
    pairs = zip(completion.logprobs, completion.token_ids, strict=True)
    return [entry[token].logprob for entry, token in pairs]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_a_request_is_bitwise_the_same_alone_and_in_a_batch(
    engine: Engine, params: SamplingParams
) -> None:
    engine.reset_prefix_cache()
    alone = engine.generate([TARGET], params, use_tqdm=False)[0]
    engine.reset_prefix_cache()
    batch = [*OTHERS[:3], TARGET, *OTHERS[3:]]
    mixed = engine.generate(batch, params, use_tqdm=False)[3]
    assert mixed.outputs[0].token_ids == alone.outputs[0].token_ids
    assert _logprobs(mixed) == _logprobs(alone)  # bitwise: floats compared with ==


def test_tiled_linear_rows_do_not_depend_on_the_number_of_rows() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator)
    rows = torch.randn(3 * ROW_TILE + 5, 64, generator=generator)
    alone = tiled_linear(rows[7:8], weight)
    for count in (8, 17, rows.shape[0]):
        assert torch.equal(tiled_linear(rows[:count], weight)[7], alone[0])
    torch.testing.assert_close(tiled_linear(rows, weight), rows @ weight.T)


@pytest.mark.parametrize("window", [None, 30])
def test_invariant_attention_equals_a_plain_softmax_with_window_and_sinks(
    window: int | None,
) -> None:
    """The fixed-split attention against one softmax over [sink, visible keys] (GPT-OSS's
    sinks: a logit per head with value zero), through a scattered block table."""
    generator = torch.Generator().manual_seed(0)
    block_size, kv_heads, heads, dim, length, queries = 16, 2, 4, 32, 90, 20
    k_cache = torch.randn(8, block_size, kv_heads, dim, generator=generator)
    v_cache = torch.randn(8, block_size, kv_heads, dim, generator=generator)
    table = torch.tensor([[3, 1, 5, 0, 2, 4, 6, 7]], dtype=torch.int32)
    query = torch.randn(queries, heads, dim, generator=generator)
    sinks = torch.randn(heads, generator=generator)
    scale = dim**-0.5
    cache = (k_cache, v_cache, None)
    out = attend_group(query, cache, table, [queries], [length], scale, window, sinks)
    positions = torch.arange(length)
    slots = table[0].long()[positions // block_size] * block_size + positions % block_size
    keys = k_cache.view(-1, kv_heads, dim)[slots].repeat_interleave(2, 1)
    values = v_cache.view(-1, kv_heads, dim)[slots].repeat_interleave(2, 1)
    query_positions = torch.arange(length - queries, length)
    scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
    hidden = positions[None] > query_positions[:, None]
    if window is not None:
        hidden |= positions[None] <= query_positions[:, None] - window
    scores = torch.cat(
        [sinks[:, None, None].expand(heads, queries, 1), scores.masked_fill(hidden, -torch.inf)],
        -1,
    )
    expected = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1)[..., 1:], values)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
