"""A checkpoint holding NaN or infinity is refused at load, naming the tensor (issue 36,
item 8): GPTQ / AWQ / FP8 scales, a norm weight, a bias, KV-cache scales by default; the big
weight matrices with ``weight_check="all"``; every tensor with ``pagedinfer check-weights``.

Before: a GPTQ checkpoint whose scales were all NaN loaded without complaint, and greedy
decoding then returned token 0 with logprob NaN.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedinfer.adapters.attention import create_backend
from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS
from pagedinfer.adapters.models.checkpoint_scan import scan_checkpoint
from pagedinfer.adapters.models.finite import (
    NonFinite,
    WeightCheck,
    checks_tensor,
    count_nonfinite,
)
from pagedinfer.adapters.models.loader import load_weights
from pagedinfer.adapters.models.quantized_checkpoint import write_quantized_checkpoint
from pagedinfer.adapters.models.registry import build_model, read_model_config
from pagedinfer.cli import EXIT_FAILURE, main
from pagedinfer.errors import ConfigurationError, NonFiniteWeightError, UnsupportedModelError

from ..quantization.quantized_helpers import BASE, make_quantized_factory


@pytest.fixture(scope="module")
def quantized(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, Path]]:
    return make_quantized_factory(make_checkpoint, tmp_path_factory)


def load(path: Path, check: WeightCheck = "default") -> None:
    model = build_model(
        read_model_config(path),
        parallel=SINGLE_PROCESS,
        backend=create_backend("torch", 16),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    load_weights(model, path, check=check)


def poisoned(source: Path, target: Path, name: str, value: float, *, where: int = 0) -> Path:
    """A copy of ``source`` whose tensor ``name`` holds ``value`` at flat index ``where``
    (every value when ``where`` is -1)."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    tensor = tensors[name]
    flat = tensor.float().flatten()
    if where < 0:
        flat[:] = value
    else:
        flat[where] = value
    tensors[name] = flat.reshape(tensor.shape).to(tensor.dtype)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


# (quantized case, tensor, value, every value?): scales of each format, norms, biases.
DEFAULT_CHECKED = [
    ("gptq-g64", "model.layers.0.self_attn.q_proj.scales", math.nan, True),  # the issue's
    ("gptq-g64", "model.layers.1.mlp.down_proj.scales", math.inf, False),
    ("awq-g64", "model.layers.0.mlp.up_proj.scales", math.nan, False),
    ("awq-g64", "model.layers.0.self_attn.k_proj.bias", -math.inf, False),  # Qwen2's biases
    ("fp8-block128", "model.layers.1.self_attn.o_proj.weight_scale_inv", math.nan, False),
    ("ct-channel", "model.layers.0.mlp.gate_proj.weight_scale", math.nan, False),
    ("gptq-g64", "model.layers.1.post_attention_layernorm.weight", math.nan, False),
    ("fp8-block128", "model.norm.weight", math.inf, False),
]


@pytest.mark.parametrize(("case", "name", "value", "every"), DEFAULT_CHECKED)
def test_non_finite_scales_norms_and_biases_are_refused_by_name(
    quantized: Callable[[str], tuple[Path, Path]],
    tmp_path: Path,
    case: str,
    name: str,
    value: float,
    every: bool,
) -> None:
    path, _ = quantized(case)
    load(path)  # the untouched checkpoint loads
    broken = poisoned(path, tmp_path / "broken", name, value, where=-1 if every else 3)
    with pytest.raises(NonFiniteWeightError) as info:
        load(broken)
    message = str(info.value)
    assert repr(name) in message and "model.safetensors" in message
    kind = "NaN" if math.isnan(value) else "infinite"
    assert f" {kind} of " in message
    assert isinstance(info.value, UnsupportedModelError)  # what load errors always were
    load(broken, check="none")  # only the check refuses it


def test_the_engine_refuses_the_issues_checkpoint(
    quantized: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    """The issue's GPTQ checkpoint (every scale NaN) through ``Engine``, with and without
    ``weight_check``."""
    from pagedinfer import Engine

    path, _ = quantized("gptq-g64")
    name = "model.layers.0.self_attn.q_proj.scales"
    broken = poisoned(path, tmp_path / "broken", name, math.nan, where=-1)
    with pytest.raises(NonFiniteWeightError, match=repr(name)):
        Engine(broken, device="cpu", num_kv_blocks=8, max_model_len=32)
    with pytest.raises(NonFiniteWeightError, match=repr(name)):
        Engine(broken, device="cpu", num_kv_blocks=8, max_model_len=32, weight_check="all")


def test_big_weight_matrices_are_checked_with_all(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = make_checkpoint("tiny")
    for index, name in enumerate(
        ("model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight")
    ):
        broken = poisoned(path, tmp_path / f"broken{index}", name, math.nan, where=7)
        load(broken)  # the default leaves the big matrices out
        with pytest.raises(NonFiniteWeightError, match=repr(name)):
            load(broken, check="all")


def test_fp8_weights_are_read_by_their_bits(
    quantized: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    path, _ = quantized("fp8-block64")
    name = "model.layers.0.self_attn.q_proj.weight"
    shutil.copytree(path, tmp_path / "broken")
    tensors = load_file(str(tmp_path / "broken" / "model.safetensors"))
    bits = tensors[name].view(torch.uint8).clone()
    bits.view(-1)[[5, 9]] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)  # +NaN, -NaN
    tensors[name] = bits.view(torch.float8_e4m3fn)
    save_file(tensors, str(tmp_path / "broken" / "model.safetensors"), metadata={"format": "pt"})
    load(tmp_path / "broken")
    with pytest.raises(NonFiniteWeightError, match="2 NaN of"):
        load(tmp_path / "broken", check="all")


def test_kv_cache_scales_are_always_checked(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    source = make_checkpoint("tiny", **BASE)
    path = write_quantized_checkpoint(
        source, tmp_path / "ct", "compressed-tensors", block=None, kv_scales=[(0.5, 0.25)] * 2
    )
    broken = poisoned(path, tmp_path / "broken", "model.layers.1.self_attn.v_scale", math.nan)
    with pytest.raises(NonFiniteWeightError, match="v_scale"):
        load(broken, check="none")  # one float per layer: always read, always checked


def test_which_tensors_each_check_reads() -> None:
    matrix, vector = torch.zeros(4, 4), torch.zeros(4)
    scales = torch.zeros(2, 4, dtype=torch.float16)
    packed = torch.zeros(4, 4, dtype=torch.int32)
    assert not checks_tensor("model.layers.0.mlp.up_proj.weight", matrix, "default")
    assert checks_tensor("model.layers.0.mlp.up_proj.weight", matrix, "all")
    assert checks_tensor("model.norm.weight", vector, "default")
    assert checks_tensor("model.layers.0.mlp.up_proj.scales", scales, "default")
    assert checks_tensor("model.layers.0.self_attn.q_proj.bias", vector, "default")
    assert not checks_tensor("model.layers.0.mlp.up_proj.qzeros", packed, "all")  # integers
    assert not checks_tensor("model.norm.weight", vector, "none")


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e5m2]
)
def test_counts_are_exact(dtype: torch.dtype) -> None:
    values = torch.linspace(-3, 3, 1000)
    values[[1, 2, 3]] = math.nan
    values[[10, 20]] = torch.tensor([math.inf, -math.inf])
    assert count_nonfinite(values.to(dtype)) == NonFinite(3, 2)
    assert count_nonfinite(torch.linspace(-3, 3, 1000).to(dtype)) == NonFinite()
    if dtype.itemsize > 1:  # finite values whose sum overflows: counted, none found
        huge = torch.full((8,), torch.finfo(dtype).max, dtype=dtype)
        assert count_nonfinite(huge) == NonFinite()


def test_the_option_is_checked() -> None:
    from pagedinfer.engine.config import EngineConfig

    with pytest.raises(ConfigurationError, match="weight_check='some'"):
        EngineConfig(model_path="x", weight_check="some")  # type: ignore[arg-type]


def test_check_weights_lists_every_non_finite_tensor(
    quantized: Callable[[str], tuple[Path, Path]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, _ = quantized("gptq-g64")
    assert main(["check-weights", str(path)]) == 0
    assert "all finite" in capsys.readouterr().out
    scale = "model.layers.0.self_attn.q_proj.scales"
    broken = poisoned(path, tmp_path / "one", scale, math.nan, where=-1)
    embedding = "model.embed_tokens.weight"
    broken = poisoned(broken, tmp_path / "two", embedding, math.inf, where=2)
    report = scan_checkpoint(broken)
    found = {finding.name: finding for finding in report.findings}
    assert set(found) == {embedding, scale}
    assert found[embedding].found == NonFinite(0, 1)
    assert found[scale].found == NonFinite(found[scale].numel, 0)
    assert main(["check-weights", str(broken)]) == EXIT_FAILURE
    out = capsys.readouterr().out
    assert f"model.safetensors: {scale}: " in out and f"{embedding}: 1 infinite of" in out
    assert main(["check-weights", str(tmp_path / "nowhere")]) == 2
