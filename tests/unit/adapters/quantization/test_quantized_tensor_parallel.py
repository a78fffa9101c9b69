"""Quantized linear layers split across ranks: every rank's slice of the weight *and of its
scales, zero points and packed words*, recombined, is the whole dequantized layer.

One rank at a time, without a process group (as ``test_parallel_layers.py``): each rank's
layer loads the full checkpoint tensors through its weight loaders (which cut this rank's
part), finishes (dequantizes, or prepares the Triton GEMM, run by the interpreter), and the
test recombines the outputs: column-parallel outputs side by side, row-parallel partial sums
added. Splits that would cut a block, a group or a packed word are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS, ParallelContext
from pagedinfer.adapters.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    checkpoint_shape,
    get_weight_loader,
)
from pagedinfer.adapters.models.quantized_checkpoint import QuantFormat, quantize_projection
from pagedinfer.adapters.quantization.awq import AwqConfig
from pagedinfer.adapters.quantization.base import QuantizationConfig
from pagedinfer.adapters.quantization.compressed_tensors import CompressedTensorsFp8Config
from pagedinfer.adapters.quantization.fp8_block import Fp8BlockConfig
from pagedinfer.adapters.quantization.gptq import GptqConfig
from pagedinfer.errors import ConfigurationError, UnsupportedModelError

CPU32: dict[str, Any] = {"dtype": torch.float32, "device": torch.device("cpu")}
HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTERMEDIATE = 192, 32, 8, 4, 256

# (format for the writer, its options, the parsed config the layers get)
FORMATS: dict[str, tuple[QuantFormat, dict[str, Any], QuantizationConfig]] = {
    "fp8-block64": ("fp8", {"block": (64, 64)}, Fp8BlockConfig((64, 64))),
    "ct-channel": ("compressed-tensors", {"block": None}, CompressedTensorsFp8Config(None, True)),
    "awq-g64": ("awq", {"group_size": 64}, AwqConfig(64)),
    "gptq-g64": ("gptq", {"group_size": 64}, GptqConfig(64, False, True, True)),
    "gptq-act-order": (
        "gptq",
        {"group_size": 64, "desc_act": True},
        GptqConfig(64, True, True, True),
    ),
    "gptq-one-group": (
        "gptq",
        {"group_size": -1, "sym": False},
        GptqConfig(None, False, False, True),
    ),
}


class OneRank(ParallelContext):
    """A rank of an N-way group whose collectives return this rank's own part."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def quantize(
    name: str, weight: torch.Tensor, input_seed: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Checkpoint tensors and dequantized weight; ``input_seed``: modules reading the same
    input share GPTQ's act-order permutation."""
    fmt, options, _ = FORMATS[name]
    return quantize_projection(
        weight,
        fmt,
        block=options.get("block"),
        group_size=options.get("group_size", 128),
        desc_act=options.get("desc_act", False),
        sym=options.get("sym", True),
        generator=torch.Generator().manual_seed(input_seed),
    )


def load_shards(
    layer: torch.nn.Module, shards: dict[Any, dict[str, torch.Tensor]], dense: bool
) -> None:
    for shard_id, tensors in shards.items():
        for suffix, tensor in tensors.items():
            param = layer.get_parameter(suffix)
            assert checkpoint_shape(param, shard_id) == tuple(tensor.shape), suffix
            get_weight_loader(param)(param, tensor, shard_id)
    assert isinstance(layer, LinearBase)
    layer.finish_loading()
    assert (layer.matmul is None) == dense


def tolerance(kernels: bool) -> dict[str, Any]:
    """The kernels add the same float32 products in another order (tiles, split K)."""
    return {"rtol": 1e-4, "atol": 1e-4} if kernels else {}


def ranks(world_size: int) -> list[ParallelContext]:
    return [OneRank(rank=rank, world_size=world_size) for rank in range(world_size)]


# Every format dequantized at TP=2; the Triton GEMMs (interpreter) for one format per kernel
# and the act-order case (each rank gathers its rows' groups from the replicated scales).
CASES = [
    *(pytest.param(name, 2, False, id=f"{name}-dense") for name in FORMATS),
    *(
        pytest.param(name, 2, True, id=f"{name}-kernel")
        for name in ("fp8-block64", "awq-g64", "gptq-act-order")
    ),
]


@pytest.mark.parametrize(("name", "world", "kernels"), CASES)
def test_qkv_and_gate_up_shards_recombine(name: str, world: int, kernels: bool) -> None:
    config = FORMATS[name][2]
    rng = torch.Generator().manual_seed(1)
    x = torch.randn(5, HIDDEN, generator=rng)
    sizes = {"q": HEADS * HEAD_DIM, "k": KV_HEADS * HEAD_DIM, "v": KV_HEADS * HEAD_DIM}
    qkv, dequantized = {}, {}
    for shard, rows in sizes.items():
        qkv[shard], dequantized[shard] = quantize(name, torch.randn(rows, HIDDEN, generator=rng), 0)
    gate_up, gate_up_dense = {}, {}
    for index in (0, 1):
        weight = torch.randn(INTERMEDIATE, HIDDEN, generator=rng)
        gate_up[index], gate_up_dense[index] = quantize(name, weight, 1)
    outputs: dict[Any, list[torch.Tensor]] = {key: [] for key in [*sizes, 0, 1]}
    for parallel in ranks(world):
        names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
        layer = QKVParallelLinear(
            HIDDEN,
            HEAD_DIM,
            HEADS,
            KV_HEADS,
            parallel=parallel,
            **CPU32,
            quant=config.make_linear(names, kernels=kernels),
        )
        load_shards(layer, qkv, dense=not kernels)
        for shard, part in zip(
            sizes, layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], -1), strict=True
        ):
            outputs[shard].append(part)
        mlp_names = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
        merged = MergedColumnParallelLinear(
            HIDDEN,
            [INTERMEDIATE, INTERMEDIATE],
            parallel=parallel,
            **CPU32,
            quant=config.make_linear(mlp_names, kernels=kernels),
        )
        load_shards(merged, gate_up, dense=not kernels)
        gate, up = merged(x).chunk(2, dim=-1)
        outputs[0].append(gate)
        outputs[1].append(up)
    for key, weight in [*dequantized.items(), *gate_up_dense.items()]:
        torch.testing.assert_close(
            torch.cat(outputs[key], -1), F.linear(x, weight), **tolerance(kernels)
        )


@pytest.mark.parametrize(("name", "world", "kernels"), CASES)
def test_row_parallel_partial_sums_add_up(name: str, world: int, kernels: bool) -> None:
    config = FORMATS[name][2]
    rng = torch.Generator().manual_seed(2)
    inputs = HEADS * HEAD_DIM
    x = torch.randn(4, inputs, generator=rng)
    tensors, dequantized = quantize(name, torch.randn(HIDDEN, inputs, generator=rng), 2)
    bias = torch.randn(HIDDEN, generator=rng)
    total = torch.zeros(4, HIDDEN)
    for parallel in ranks(world):
        layer = RowParallelLinear(
            inputs,
            HIDDEN,
            parallel=parallel,
            **CPU32,
            bias=True,
            quant=config.make_linear(["model.layers.0.self_attn.o_proj"], kernels=kernels),
        )
        load_shards(layer, {None: {**tensors, "bias": bias}}, dense=not kernels)
        columns = slice(parallel.rank * inputs // world, (parallel.rank + 1) * inputs // world)
        total += layer(x[:, columns])
    torch.testing.assert_close(total, F.linear(x, dequantized, bias), **tolerance(kernels))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        # k and v have 128 rows: 64 per rank cuts a 128-row FP8 block.
        (
            lambda p: QKVParallelLinear(
                HIDDEN, 32, 8, 4, parallel=p, **CPU32,
                quant=Fp8BlockConfig((128, 128)).make_linear(["qkv"], kernels=False),
            ),
            "tensor_parallel_size=2 gives each rank 64 of its 128 output features",
        ),
        # 192 input features over 2 ranks: 96 per rank cuts AWQ's groups of 64.
        (
            lambda p: RowParallelLinear(
                192, HIDDEN, parallel=p, **CPU32,
                quant=AwqConfig(64).make_linear(["o_proj"], kernels=False),
            ),
            "96 of its 192 input features",
        ),
        # 36 output features per rank: not whole int32 words of 8 (GPTQ's packed zeros).
        (
            lambda p: MergedColumnParallelLinear(
                HIDDEN, [72, 72], parallel=p, **CPU32,
                quant=GptqConfig(64, False, True, True).make_linear(["g", "u"], kernels=False),
            ),
            "36 of its 72 output features",
        ),
    ],
)  # fmt: skip
def test_splits_that_cut_a_block_group_or_word_are_refused(
    build: Callable[[ParallelContext], object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        build(ParallelContext(rank=0, world_size=2))


def test_a_packed_shard_must_end_on_a_block_boundary() -> None:
    """At TP=1 only the last packed shard may end in a partial block (as in vLLM): gate's
    200 rows would make up's first rows share gate's last block scale."""
    with pytest.raises(ConfigurationError, match="packed shards hold 200"):
        MergedColumnParallelLinear(
            HIDDEN,
            [200, 200],
            parallel=SINGLE_PROCESS,
            **CPU32,
            quant=Fp8BlockConfig((128, 128)).make_linear(["g", "u"], kernels=False),
        )


def test_sizes_the_format_cannot_hold_are_refused() -> None:
    """AWQ needs whole groups (192 inputs, groups of 128); the message names the module."""
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.mlp\.down_proj: 192 input"):
        RowParallelLinear(
            192,
            HIDDEN,
            parallel=SINGLE_PROCESS,
            **CPU32,
            quant=AwqConfig(128).make_linear(["model.layers.0.mlp.down_proj"], kernels=False),
        )
