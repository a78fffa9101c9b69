"""``quantization_config`` parsing: the published configs are understood, every unsupported
method or variant is refused naming it; the packed layouts, checked against words written
out by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.quantized_checkpoint import (
    _pack_awq,
    _pack_gptq_columns,
    _pack_gptq_rows,
)
from pagedinfer.adapters.quantization import parse_quantization_config
from pagedinfer.adapters.quantization.base import matches_module
from pagedinfer.adapters.quantization.fp8 import dequantize_fp8, quantize_fp8
from pagedinfer.adapters.quantization.int4 import (
    AWQ_POSITIONS,
    SEQUENTIAL_POSITIONS,
    pack_int4,
    unpack_int4,
)
from pagedinfer.errors import UnsupportedModelError

PATH = Path("/models/quantized")

QWEN3_FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
FP8_DYNAMIC: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                        "strategy": "channel", "group_size": None, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                  "dynamic": True, "strategy": "token"},
            "output_activations": None,
        }
    },
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "sparsity_config": {},
}  # fmt: skip
AWQ = {
    "quant_method": "awq",
    "bits": 4,
    "group_size": 128,
    "zero_point": True,
    "version": "gemm",
    "modules_to_not_convert": None,
}
GPTQ = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "desc_act": True,
    "sym": True,
    "damp_percent": 0.01,
    "checkpoint_format": "gptq",
}


def group(**changes: Any) -> dict[str, Any]:
    """FP8_DYNAMIC with its one group's fields changed (``weights={...}`` merges)."""
    config = {
        **FP8_DYNAMIC,
        "config_groups": {"group_0": dict(FP8_DYNAMIC["config_groups"]["group_0"])},
    }
    target = config["config_groups"]["group_0"]
    for key, value in changes.items():
        target[key] = (
            {**target[key], **value} if isinstance(value, dict) and target.get(key) else value
        )
    return config


@pytest.mark.parametrize(
    ("raw", "described"),
    [
        (QWEN3_FP8, "fp8 (e4m3 weights, 128x128 blocks)"),
        (FP8_DYNAMIC, "compressed-tensors (FP8 weights, per-channel scales)"),
        (
            group(
                weights={"strategy": "block", "block_structure": [128, 128]},
                input_activations={"strategy": "group", "group_size": 128},
            ),
            "compressed-tensors (FP8 weights, 128x128-block scales)",
        ),
        (group(input_activations=None), "compressed-tensors (FP8 weights, per-channel scales)"),
        (AWQ, "awq (4-bit, group size 128, zero points)"),
        (
            {
                "quant_method": "awq",
                "w_bit": 4,
                "q_group_size": 64,
                "zero_point": True,
                "version": "GEMM",
            },
            "awq (4-bit, group size 64, zero points)",
        ),
        (GPTQ, "gptq (4-bit, group size 128, act-order, symmetric)"),
        (
            {
                **GPTQ,
                "group_size": -1,
                "desc_act": False,
                "sym": False,
                "checkpoint_format": "gptq_v2",
            },
            "gptq (4-bit, one group, asymmetric)",
        ),
    ],
)
def test_published_configs_parse(raw: dict[str, Any], described: str) -> None:
    config = parse_quantization_config(raw, PATH)
    assert config is not None and config.describe() == described


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
        ({"bits": 4}, "quant_method=None"),
        ({**QWEN3_FP8, "fmt": "e5m2"}, "fmt='e5m2'"),
        ({**QWEN3_FP8, "activation_scheme": "static"}, "activation_scheme='static'"),
        ({k: v for k, v in QWEN3_FP8.items() if k != "weight_block_size"}, "per-tensor FP8"),
        ({**QWEN3_FP8, "weight_block_size": [128]}, "weight_block_size=[128]"),
        ({**AWQ, "bits": 8}, "bits=8"),
        ({**AWQ, "version": "gemv"}, "version='gemv'"),
        ({**AWQ, "zero_point": False}, "zero_point=false"),
        ({**AWQ, "group_size": 0}, "group_size=0"),
        ({**GPTQ, "bits": 3}, "bits=3"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
        ({**GPTQ, "lm_head": True}, "lm_head=true"),
        ({**GPTQ, "dynamic": {"-:.*down_proj": {}}}, "dynamic"),
        (group(weights={"num_bits": 4, "type": "int"}), "num_bits=4"),
        (group(weights={"strategy": "tensor"}), "strategy='tensor'"),
        (group(weights={"strategy": "group", "group_size": 128}), "strategy='group'"),
        (group(input_activations={"dynamic": False}), "dynamic=False"),
        (group(targets=["Linear", "Embedding"]), "targets="),
        (group(output_activations={"num_bits": 8}), "output_activations"),
        ({**FP8_DYNAMIC, "format": "pack-quantized"}, "format='pack-quantized'"),
        (
            {**FP8_DYNAMIC, "config_groups": {**FP8_DYNAMIC["config_groups"], "group_1": {}}},
            "exactly one group",
        ),
        (
            {
                **FP8_DYNAMIC,
                "kv_cache_scheme": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "attn_head",
                    "dynamic": False,
                },
            },
            "kv_cache_scheme",
        ),
        ({**FP8_DYNAMIC, "sparsity_config": {"format": "sparse-24"}}, "sparsity_config"),
    ],
)
def test_unsupported_methods_and_variants_are_named(raw: dict[str, Any], fragment: str) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        parse_quantization_config(raw, PATH)
    message = str(info.value)
    assert fragment in message and str(PATH) in message, message


def test_model_config_carries_the_quantization() -> None:
    raw = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
    }
    assert ModelConfig.from_dict(raw, PATH).quantization is None
    config = ModelConfig.from_dict({**raw, "quantization_config": QWEN3_FP8}, PATH)
    assert config.quantization is not None and config.quantization.method == "fp8"


def test_ignore_lists_match_whole_module_names() -> None:
    name = "model.layers.3.mlp.down_proj"
    assert matches_module(name, [name])
    assert matches_module(name, ["mlp.down_proj"])
    assert matches_module(name, ["model.layers.3"])
    assert matches_module(name, [r"re:.*layers\.3\..*"])
    assert not matches_module(name, ["model.layers.33"])
    assert not matches_module(name, ["down"])
    assert not matches_module(name, ["re:.*up_proj"])
    assert not matches_module("lm_head", ["model.layers.3"])


def test_a_packed_layer_is_quantized_all_or_none() -> None:
    config = parse_quantization_config(
        {**QWEN3_FP8, "modules_to_not_convert": ["self_attn.k_proj"]}, PATH
    )
    assert config is not None
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    with pytest.raises(UnsupportedModelError, match=r"\['model.layers.0.self_attn.k_proj'\]"):
        config.linear_method(names, kernels=False)
    assert config.linear_method(["model.layers.0.self_attn.o_proj"], kernels=False) is not None
    both = parse_quantization_config({**QWEN3_FP8, "modules_to_not_convert": ["self_attn"]}, PATH)
    assert both is not None and both.linear_method(names, kernels=False) is None


# ---------------------------------------------------------------- layouts, by hand


def test_awq_packs_columns_in_its_interleaved_order() -> None:
    """Columns 0..7 holding values 0..7: AutoAWQ's order_map [0, 2, 4, 6, 1, 3, 5, 7] puts
    columns 0, 2, 4, 6 in nibbles 0-3 and 1, 3, 5, 7 in nibbles 4-7: 0x75316420."""
    values = torch.arange(8).view(1, 8)
    word = 0x75316420
    assert _pack_awq(values).tolist() == [[word]]
    assert unpack_int4(torch.tensor([[word]], dtype=torch.int32), 1, AWQ_POSITIONS).tolist() == [
        list(range(8))
    ]
    assert pack_int4(values, 1, AWQ_POSITIONS).tolist() == [[word]]


def test_gptq_packs_input_features_in_order_and_zeros_minus_one() -> None:
    """Input features 0..7 with values 8..15 in one column: 0xFEDCBA98 (as int32: negative);
    zero points of 8 stored minus one: 0x77777777."""
    values = torch.arange(8, 16).view(8, 1)
    word = 0xFEDCBA98 - 2**32
    assert _pack_gptq_rows(values).tolist() == [[word]]
    assert unpack_int4(torch.tensor([[word]], dtype=torch.int32), 0, SEQUENTIAL_POSITIONS).view(
        -1
    ).tolist() == list(range(8, 16))
    assert _pack_gptq_columns(torch.full((1, 8), 8) - 1).tolist() == [[0x77777777]]


def test_fp8_block_scale_is_the_block_maximum_over_448() -> None:
    """Two 2x2 blocks: the first's largest magnitude is 448 (scale 1, values stored as they
    are), the second's 4.48 (scale 0.01); a partial last block has its own scale."""
    weight = torch.tensor([[448.0, -1.0, 4.48, 0.5, 3.0], [2.0, 0.25, -2.0, 1.0, -6.0]])
    quantized, scale = quantize_fp8(weight, (2, 2))
    torch.testing.assert_close(scale, torch.tensor([[1.0, 0.01, 6.0 / 448]]))
    assert quantized.float()[:, 0].tolist() == [448.0, 2.0]
    restored = dequantize_fp8(quantized, scale, (2, 2))
    assert bool(((restored - weight).abs() <= weight.abs() * 2**-4 + 1e-6).all())
