"""Tensor-parallel layers, one rank at a time: each rank's shard, recombined, is the full layer.

No process group is needed: a rank is a ``ParallelContext(rank=r, world_size=N)`` whose
collectives are replaced by local stand-ins, and the test performs the reduction itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS, ParallelContext
from pagedinfer.adapters.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedinfer.adapters.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    get_weight_loader,
)
from pagedinfer.errors import ConfigurationError

HIDDEN = 12
CPU32: dict[str, Any] = {"dtype": torch.float32, "device": torch.device("cpu")}


class OneRank(ParallelContext):
    """A rank of an N-way group whose collectives return this rank's own part."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_to_driver(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        return tensor


def ranks(world_size: int) -> list[OneRank]:
    return [OneRank(rank=rank, world_size=world_size) for rank in range(world_size)]


def load(
    layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard_id: str | int | None = None
) -> None:
    param = layer.get_parameter(name)
    get_weight_loader(param)(param, tensor, shard_id)


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_qkv_shards_are_this_ranks_heads(world_size: int, rng: torch.Generator) -> None:
    heads, kv_heads, head_dim = 8, 4, 3
    q = torch.randn(heads * head_dim, HIDDEN, generator=rng)
    k = torch.randn(kv_heads * head_dim, HIDDEN, generator=rng)
    v = torch.randn(kv_heads * head_dim, HIDDEN, generator=rng)
    weights = {"q": q, "k": k, "v": v}
    biases = {name: torch.randn(w.shape[0], generator=rng) for name, w in weights.items()}
    x = torch.randn(5, HIDDEN, generator=rng)
    full = {"q": F.linear(x, q, biases["q"]), "k": F.linear(x, k, biases["k"])}
    full["v"] = F.linear(x, v, biases["v"])
    parts: dict[str, list[torch.Tensor]] = {"q": [], "k": [], "v": []}
    for parallel in ranks(world_size):
        layer = QKVParallelLinear(
            HIDDEN, head_dim, heads, kv_heads, parallel=parallel, **CPU32, bias=True
        )
        for shard_id, weight in weights.items():
            load(layer, "weight", weight, shard_id)
            load(layer, "bias", biases[shard_id], shard_id)
        assert (layer.num_heads, layer.num_kv_heads) == (
            heads // world_size,
            kv_heads // world_size,
        )
        out_q, out_k, out_v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        parts["q"].append(out_q)
        parts["k"].append(out_k)
        parts["v"].append(out_v)
    for name in "qkv":
        torch.testing.assert_close(torch.cat(parts[name], dim=-1), full[name])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_merged_gate_up_shards(world_size: int, rng: torch.Generator) -> None:
    intermediate = 8
    gate = torch.randn(intermediate, HIDDEN, generator=rng)
    up = torch.randn(intermediate, HIDDEN, generator=rng)
    x = torch.randn(3, HIDDEN, generator=rng)
    gates, ups = [], []
    for parallel in ranks(world_size):
        layer = MergedColumnParallelLinear(
            HIDDEN, [intermediate, intermediate], parallel=parallel, **CPU32
        )
        load(layer, "weight", gate, 0)
        load(layer, "weight", up, 1)
        local_gate, local_up = layer(x).chunk(2, dim=-1)
        gates.append(local_gate)
        ups.append(local_up)
    torch.testing.assert_close(torch.cat(gates, dim=-1), F.linear(x, gate))
    torch.testing.assert_close(torch.cat(ups, dim=-1), F.linear(x, up))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_column_parallel_shards(world_size: int, rng: torch.Generator) -> None:
    weight = torch.randn(6, HIDDEN, generator=rng)
    bias = torch.randn(6, generator=rng)
    x = torch.randn(4, HIDDEN, generator=rng)
    outputs = []
    for parallel in ranks(world_size):
        layer = ColumnParallelLinear(HIDDEN, 6, parallel=parallel, **CPU32, bias=True)
        load(layer, "weight", weight)
        load(layer, "bias", bias)
        outputs.append(layer(x))
    torch.testing.assert_close(torch.cat(outputs, dim=-1), F.linear(x, weight, bias))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_row_parallel_partial_sums_add_up(world_size: int, rng: torch.Generator) -> None:
    weight = torch.randn(HIDDEN, 8, generator=rng)
    bias = torch.randn(HIDDEN, generator=rng)
    x = torch.randn(4, 8, generator=rng)
    total = torch.zeros(4, HIDDEN)
    for parallel in ranks(world_size):
        layer = RowParallelLinear(8, HIDDEN, parallel=parallel, **CPU32, bias=True)
        load(layer, "weight", weight)
        load(layer, "bias", bias)
        assert layer.weight.shape == (HIDDEN, 8 // world_size)
        columns = slice(parallel.rank * 8 // world_size, (parallel.rank + 1) * 8 // world_size)
        total += layer(x[:, columns])  # the input arrives already split (column-parallel output)
    # The bias is added once (by rank 0), not world_size times.
    torch.testing.assert_close(total, F.linear(x, weight, bias))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_vocab_parallel_embedding_and_head(world_size: int, rng: torch.Generator) -> None:
    vocab = 16
    weight = torch.randn(vocab, HIDDEN, generator=rng)
    ids = torch.tensor([0, 3, 15, 8, 7, 4, 12])
    hidden = torch.randn(2, HIDDEN, generator=rng)
    embedded = torch.zeros(len(ids), HIDDEN)
    logits = []
    for parallel in ranks(world_size):
        embedding = VocabParallelEmbedding(vocab, HIDDEN, parallel=parallel, **CPU32)
        load(embedding, "weight", weight)
        assert embedding.weight.shape == (vocab // world_size, HIDDEN)
        embedded += embedding(ids)  # ids outside this rank's range contribute zeros
        head = ParallelLMHead(vocab, HIDDEN, parallel=parallel, **CPU32)
        load(head, "weight", weight)
        local = head(hidden)
        assert local is not None
        logits.append(local)
    torch.testing.assert_close(embedded, F.embedding(ids, weight))
    torch.testing.assert_close(torch.cat(logits, dim=-1), hidden @ weight.T)


def test_single_process_head_returns_full_logits(rng: torch.Generator) -> None:
    weight = torch.randn(10, HIDDEN, generator=rng)
    head = ParallelLMHead(10, HIDDEN, parallel=SINGLE_PROCESS, **CPU32)
    load(head, "weight", weight)
    hidden = torch.randn(3, HIDDEN, generator=rng)
    logits = head(hidden)
    assert logits is not None
    torch.testing.assert_close(logits, hidden @ weight.T)


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (
            lambda p: QKVParallelLinear(HIDDEN, 2, 4, 2, parallel=p, **CPU32),
            "num_attention_heads=4",
        ),
        (
            lambda p: QKVParallelLinear(HIDDEN, 2, 6, 2, parallel=p, **CPU32),
            "num_key_value_heads=2",
        ),
        (
            lambda p: MergedColumnParallelLinear(HIDDEN, [10, 10], parallel=p, **CPU32),
            "intermediate_size",
        ),
        (lambda p: RowParallelLinear(10, HIDDEN, parallel=p, **CPU32), "10"),
        (lambda p: VocabParallelEmbedding(10, HIDDEN, parallel=p, **CPU32), "vocab_size=10"),
        (lambda p: ParallelLMHead(10, HIDDEN, parallel=p, **CPU32), "vocab_size=10"),
    ],
)
def test_uneven_splits_are_configuration_errors(
    build: Callable[[ParallelContext], object], fragment: str
) -> None:
    world_size = 3
    with pytest.raises(ConfigurationError, match=fragment) as info:
        build(ParallelContext(rank=0, world_size=world_size))
    assert "tensor_parallel_size=3" in str(info.value)


def test_kv_heads_fewer_than_ranks_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="num_key_value_heads=2"):
        QKVParallelLinear(HIDDEN, 2, 8, 2, parallel=ParallelContext(rank=0, world_size=4), **CPU32)


def test_shape_mismatch_is_reported(rng: torch.Generator) -> None:
    layer = ColumnParallelLinear(HIDDEN, 6, parallel=SINGLE_PROCESS, **CPU32)
    with pytest.raises(ValueError, match="shape"):
        load(layer, "weight", torch.randn(6, HIDDEN + 1, generator=rng))
