"""Logprobs: the chosen token and the top-k of log_softmax, vLLM's ranks, chunked prompt rows."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.adapters.sampling.logprobs import compute_logprobs, gather_logprobs, prompt_logprobs


@pytest.mark.parametrize(("rows", "vocab", "k"), [(1, 8, 0), (4, 100, 3), (9, 1000, 20)])
def test_gather_matches_log_softmax(rows: int, vocab: int, k: int) -> None:
    generator = torch.Generator().manual_seed(k)
    logits = torch.randn(rows, vocab, generator=generator) * 5
    chosen = torch.randint(0, vocab, (rows,), generator=generator)
    result = gather_logprobs(compute_logprobs(logits), chosen, k)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert result.token_ids.shape == result.logprobs.shape == (rows, 1 + k)
    assert result.token_ids[:, 0].tolist() == chosen.tolist()
    for row in range(rows):
        ids = result.token_ids[row].tolist()
        torch.testing.assert_close(
            result.logprobs[row].double(), reference[row, ids], rtol=0, atol=1e-5
        )
        assert ids[1:] == reference[row].topk(k).indices.tolist()
        order = reference[row].argsort(descending=True).tolist()
        assert result.ranks[row] == order.index(chosen[row].item()) + 1


def test_ranks_count_ties_like_vllm() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    result = gather_logprobs(compute_logprobs(logits), torch.tensor([1]), 2)
    assert result.ranks.tolist() == [2]  # two tokens have a logprob >= its own
    result = gather_logprobs(compute_logprobs(logits), torch.tensor([3]), 0)
    assert result.ranks.tolist() == [4]


def test_bfloat16_logits_give_float32_logprobs() -> None:
    logits = torch.randn(2, 50).to(torch.bfloat16)
    logprobs = compute_logprobs(logits)
    assert logprobs.dtype is torch.float32
    torch.testing.assert_close(logprobs.exp().sum(-1), torch.ones(2))


def test_prompt_logprobs_in_chunks_equal_one_pass() -> None:
    generator = torch.Generator().manual_seed(3)
    head = torch.randn(16, 64, generator=generator)
    hidden = torch.randn(37, 16, generator=generator)
    targets = torch.randint(0, 64, (37,), generator=generator)
    calls: list[int] = []

    def compute_logits(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return rows @ head

    chunked = prompt_logprobs(compute_logits, hidden, targets, 4, max_rows=10)
    assert calls == [10, 10, 10, 7]
    whole = gather_logprobs(compute_logprobs(hidden @ head), targets, 4)
    assert torch.equal(chunked.token_ids, whole.token_ids)
    assert torch.equal(chunked.ranks, whole.ranks)
    torch.testing.assert_close(chunked.logprobs, whole.logprobs)
    ids, logprobs, ranks = chunked.tolist()
    assert len(ids) == len(logprobs) == len(ranks) == 37
