"""Quantized checkpoints (FP8 block-wise, compressed-tensors FP8, AWQ, GPTQ) load exactly and
generate what their dequantized weights generate; broken ones are refused by name.

Each checkpoint is a random model quantized in the published layout
(``quantized_checkpoint.py``, packing loops written as the tools write them) next to a
float32 checkpoint holding the dequantized weights, computed from the integers and scales
*before* packing. So the loader's unpacking (AWQ's nibble order, GPTQ's zero-point offset and
act-order ``g_idx``, FP8 block scales over partial blocks) is checked against an independent
computation, not against itself.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedinfer.adapters.attention import create_backend
from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS
from pagedinfer.adapters.layers.linear import LinearBase
from pagedinfer.adapters.models.base import CausalLM
from pagedinfer.adapters.models.loader import load_weights
from pagedinfer.adapters.models.quantized_checkpoint import write_quantized_checkpoint
from pagedinfer.adapters.models.registry import build_model, read_model_config
from pagedinfer.domain import SamplingParams
from pagedinfer.errors import UnsupportedModelError

from ..runner_helpers import generate, make_runner, random_prompts
from .quantized_helpers import BASE, CASES, make_quantized_factory

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def quantized(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, Path]]:
    return make_quantized_factory(make_checkpoint, tmp_path_factory)


def load(path: Path, backend: str = "torch") -> CausalLM:
    config = read_model_config(path)
    model = build_model(
        config,
        parallel=SINGLE_PROCESS,
        backend=create_backend(backend, 16),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    load_weights(model, path)
    return model


def edited_copy(
    source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], object]
) -> Path:
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def edit_config(path: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------- loading is exact


@pytest.mark.parametrize("case", sorted(CASES))
def test_dequantized_weights_equal_the_reference(
    case: str, quantized: Callable[[str], tuple[Path, Path]], make_checkpoint: Callable[..., Path]
) -> None:
    """Bit for bit the reference's weights, and within the format's rounding of the weights
    that were quantized (a wrong nibble order or zero point is off by whole steps)."""
    path, reference = quantized(case)
    loaded, expected = load(path).state_dict(), load(reference).state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name
    original = load(make_checkpoint("tiny", **(BASE | CASES[case].model))).state_dict()
    fmt = CASES[case].fmt
    for name, tensor in loaded.items():
        weight = original[name]
        error = (tensor - weight).abs()
        if fmt in ("fp8", "compressed-tensors"):
            # e4m3: 3 mantissa bits (relative 2^-4), subnormal steps of scale * 2^-9.
            bound = weight.abs() * 2**-4 + weight.abs().max() / 448 * 2**-8
        else:  # 4 bits: half a step; a step is at most 2 * max|W| / 15
            bound = torch.full_like(weight, float(weight.abs().max()) / 15 * 1.01)
        assert bool((error <= bound).all()), (name, float((error - bound).max()))


def test_quantized_layers_hold_no_dense_copy_on_the_kernel_path(
    quantized: Callable[[str], tuple[Path, Path]],
) -> None:
    """The Triton path keeps the quantized tensors (the interpreter runs the kernels); the
    torch path dequantizes into a dense weight; a module the config ignores stays dense."""
    path, _ = quantized("fp8-block128")
    kernel, dense = load(path, "triton"), load(path, "torch")
    linears = {n: m for n, m in kernel.named_modules() if isinstance(m, LinearBase)}
    assert linears
    for name, layer in linears.items():
        ignored = name == "model.layers.1.mlp.down_proj"
        assert (layer.matmul is None) == ignored, name
        if not ignored:
            assert layer.matmul is not None
            assert layer.matmul.get_parameter("weight").dtype == torch.float8_e4m3fn
    for name, layer in dense.named_modules():
        if isinstance(layer, LinearBase):
            assert layer.matmul is None and layer.weight.dtype == torch.float32, name


# ---------------------------------------------------------------- outputs


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_the_dequantized_reference(
    case: str, quantized: Callable[[str], tuple[Path, Path]]
) -> None:
    """Chunked prefill, a shared prefix and decode: the same tokens as the reference."""
    path, reference = quantized(case)
    prompts = random_prompts(seed=7, count=3, lengths=(3, 40))
    settings = {"max_num_batched_tokens": 32}
    tokens, _ = generate(make_runner(path, **settings), prompts, GREEDY)
    expected, _ = generate(make_runner(reference, **settings), prompts, GREEDY)
    assert tokens == expected


@pytest.mark.parametrize("case", ["fp8-block128", "gptq-act-order"])
def test_triton_kernels_give_the_reference_tokens(
    case: str, quantized: Callable[[str], tuple[Path, Path]]
) -> None:
    """The quantized GEMMs (Triton's interpreter) inside the whole model: the reference's
    greedy tokens (float32, IEEE dots: only the summation order differs)."""
    path, reference = quantized(case)
    prompts = random_prompts(seed=3, count=2, lengths=(4, 20))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    runner = make_runner(path, attention_backend="triton", max_num_batched_tokens=32)
    assert any(isinstance(m, LinearBase) and m.matmul is not None for m in runner.model.modules())
    tokens, _ = generate(runner, prompts, params)
    expected, _ = generate(make_runner(reference), prompts, params)
    assert tokens == expected


# ---------------------------------------------------------------- refusals


def test_a_missing_scale_is_named(
    quantized: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    path, _ = quantized("fp8-block128")
    name = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    broken = edited_copy(path, tmp_path / "missing", lambda tensors: tensors.pop(name))
    with pytest.raises(UnsupportedModelError, match="is missing weights") as info:
        load(broken)
    assert repr(name) in str(info.value)


def test_a_missing_zero_point_is_named(
    quantized: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    path, _ = quantized("awq-g64")
    name = "model.layers.1.mlp.up_proj.qzeros"
    broken = edited_copy(path, tmp_path / "missing", lambda tensors: tensors.pop(name))
    with pytest.raises(UnsupportedModelError, match="is missing weights") as info:
        load(broken)
    assert repr(name) in str(info.value)


@pytest.mark.parametrize(
    ("case", "edit", "described"),
    [
        # Quantized with groups of 64, config.json says 128.
        (
            "gptq-g64",
            lambda config: config["quantization_config"].update(group_size=128),
            "group of 128 input features",
        ),
        # Blocks of 64 written, config.json says 128.
        (
            "fp8-block64",
            lambda config: config["quantization_config"].update(weight_block_size=[128, 128]),
            "one scale per 128x128 block",
        ),
    ],
)
def test_a_wrong_group_or_block_size_is_named(
    quantized: Callable[[str], tuple[Path, Path]],
    tmp_path: Path,
    case: str,
    edit: Callable[[dict[str, Any]], object],
    described: str,
) -> None:
    """The first tensor whose shape the stated group or block size contradicts is named,
    with both shapes and the layout config.json implies."""
    path, _ = quantized(case)
    broken = shutil.copytree(path, tmp_path / "resized")
    edit_config(broken, edit)
    with pytest.raises(UnsupportedModelError, match="does not match the shape") as info:
        load(broken)
    message = str(info.value)
    named = message.split("tensor '")[1].split("'")[0]
    suffix = named.rsplit(".", 1)[1]
    assert suffix in {"qzeros", "scales", "weight_scale_inv"}, message
    tensors = load_file(str(path / "model.safetensors"))
    assert f"shape {list(tensors[named].shape)}" in message
    assert described in message and "quantization_config" in message


def test_a_quantized_checkpoint_without_its_config_is_refused(
    quantized: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    path, _ = quantized("ct-channel")
    broken = shutil.copytree(path, tmp_path / "unnamed")
    edit_config(broken, lambda config: config.pop("quantization_config"))
    with pytest.raises(UnsupportedModelError, match="has no quantization_config") as info:
        load(broken)
    assert "F8_E4M3" in str(info.value) and ".weight'" in str(info.value)


def test_a_dense_tensor_where_the_format_expects_fp8_is_named(
    quantized: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    """A module left dense without being listed in the ignore list."""
    path, _ = quantized("fp8-block64")
    name = "model.layers.0.mlp.down_proj.weight"

    def densify(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].float()
        del tensors["model.layers.0.mlp.down_proj.weight_scale_inv"]

    broken = edited_copy(path, tmp_path / "dense", densify)
    with pytest.raises(UnsupportedModelError, match="expected F8_E4M3") as info:
        load(broken)
    assert repr(name) in str(info.value) and "F32" in str(info.value)


def test_an_fp8_tensor_in_an_ignored_module_is_named(
    quantized: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    path, _ = quantized("fp8-block64")
    broken = shutil.copytree(path, tmp_path / "ignored")
    edit_config(
        broken,
        lambda config: config["quantization_config"].update(
            modules_to_not_convert=["model.layers.0.self_attn.o_proj"]
        ),
    )
    with pytest.raises(UnsupportedModelError, match="leaves this tensor's module") as info:
        load(broken)
    assert "'model.layers.0.self_attn.o_proj.weight'" in str(info.value)


def test_gptq_g_idx_must_agree_across_packed_modules(
    quantized: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    path, _ = quantized("gptq-act-order")

    def shuffle(tensors: dict[str, torch.Tensor]) -> None:
        name = "model.layers.0.mlp.up_proj.g_idx"
        tensors[name] = tensors[name].flip(0).contiguous()

    broken = edited_copy(path, tmp_path / "shuffled", shuffle)
    with pytest.raises(UnsupportedModelError, match="differs from") as info:
        load(broken)
    assert "model.layers.0.mlp.up_proj.g_idx" in str(info.value)


def test_gptq_g_idx_out_of_range_is_refused(
    quantized: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    path, _ = quantized("gptq-g64")

    def corrupt(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.1.self_attn.o_proj.g_idx"][5] = 9

    broken = edited_copy(path, tmp_path / "corrupt", corrupt)
    with pytest.raises(UnsupportedModelError, match="group indices") as info:
        load(broken)
    assert "model.layers.1.self_attn.o_proj.g_idx" in str(info.value)


def test_gptq_without_g_idx_uses_sequential_groups(
    quantized: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    path, reference = quantized("gptq-g64")

    def drop(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.endswith(".g_idx")]:
            del tensors[name]

    stripped = edited_copy(path, tmp_path / "no-g-idx", drop)
    loaded, expected = load(stripped).state_dict(), load(reference).state_dict()
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)


def test_quantized_moe_is_refused(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    source = make_checkpoint("tiny", architecture="Qwen3MoeForCausalLM")
    path = write_quantized_checkpoint(source, tmp_path / "moe", "fp8", block=(32, 32))
    with pytest.raises(UnsupportedModelError, match="quantized Qwen3-MoE"):
        read_model_config(path)


# ---------------------------------------------------------------- FP8 KV-cache scales


def test_kv_cache_scales_reach_the_attention_layers(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    source = make_checkpoint("tiny", **BASE)
    scales = [(0.25, 0.5), (0.125, 2.0)]
    path = write_quantized_checkpoint(
        source, tmp_path / "kv", "compressed-tensors", block=None, kv_scales=scales
    )
    layers = load(path).attention_layers()
    assert [(a.checkpoint_k_scale, a.checkpoint_v_scale) for a in layers] == scales


def test_a_per_channel_kv_scale_is_refused(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    source = make_checkpoint("tiny", **BASE)
    path = write_quantized_checkpoint(
        source, tmp_path / "kv", "compressed-tensors", block=None, kv_scales=[(1.0, 1.0)] * 2
    )
    name = "model.layers.1.self_attn.v_scale"

    def widen(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = torch.ones(128)

    broken = edited_copy(path, tmp_path / "per-channel", widen)
    with pytest.raises(UnsupportedModelError, match="one float per layer") as info:
        load(broken)
    assert repr(name) in str(info.value)
