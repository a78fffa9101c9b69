"""GPT-OSS MXFP4 checkpoints: expert weights dequantized at load, as transformers does.

A tiny random GPT-OSS has its expert projections quantized (``tests/mxfp4_checkpoint.py``:
nearest FP4 E2M1 value per group of 32 input features, a power-of-two E8M0 scale per group)
and saved as the released checkpoints store them (``<proj>_blocks`` / ``<proj>_scales``,
``quantization_config`` ``{"quant_method": "mxfp4", ...}``). The dequantizer must equal
transformers' ``convert_moe_packed_tensors`` bit for bit, and the engine on the MXFP4
checkpoint must generate transformers' greedy tokens on the same model with the dequantized
experts.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_reference import hf_greedy
from mxfp4_checkpoint import GPT_OSS, MXFP4_CONFIG, quantize_mxfp4, write_mxfp4_pair
from pagedinfer import Engine, SamplingParams
from pagedinfer.adapters.attention import create_backend
from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.loader import load_weights
from pagedinfer.adapters.models.registry import build_model, read_model_config
from pagedinfer.adapters.quantization.mxfp4 import FP4_E2M1_VALUES, dequantize_mxfp4
from pagedinfer.errors import UnsupportedModelError


@pytest.fixture(scope="module")
def checkpoints(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """(the MXFP4 checkpoint, the dense one with its dequantized experts)."""
    root = tmp_path_factory.mktemp("mxfp4")
    write_mxfp4_pair(make_checkpoint("tiny", **GPT_OSS), root / "mxfp4", root / "reference")
    return root / "mxfp4", root / "reference"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantizer_equals_transformers(dtype: torch.dtype) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(100, 140, (3, 10, 4), dtype=torch.uint8, generator=generator)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == (3, 128, 10) and ours.dtype == dtype
    assert torch.equal(ours, theirs)


def test_quantizer_round_trips_fp4_values() -> None:
    values = torch.tensor(FP4_E2M1_VALUES).repeat(4)[:64] * 0.25  # a 2**-2 scale per group
    weight = values.reshape(1, 64, 1)
    blocks, scales = quantize_mxfp4(weight)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), weight)


def test_engine_on_mxfp4_matches_transformers_on_the_dequantized_model(
    checkpoints: tuple[Path, Path],
) -> None:
    mxfp4, reference = checkpoints
    prompts = [[(7 * i + 3 * j) % 256 for j in range(20 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with Engine(mxfp4, device="cpu", dtype="float32", kv_block_size=16) as engine:
        assert "mxfp4" in engine.describe()
        outputs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(reference, prompt, 8)


class OneRank(ParallelContext):
    """A rank of an N-way group, built alone (no process group)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_rank_holds_its_slice_of_the_dequantized_experts(
    checkpoints: tuple[Path, Path], world_size: int
) -> None:
    """The dequantized experts go through the parameters' weight loaders: every rank's model
    built from the MXFP4 checkpoint holds exactly what it holds from the dequantized one."""

    def load(path: Path, rank: int) -> dict[str, torch.Tensor]:
        model = build_model(
            read_model_config(path),
            parallel=OneRank(rank=rank, world_size=world_size),
            backend=create_backend("torch", 16),
            device=torch.device("cpu"),
            dtype=torch.float32,
        )
        load_weights(model, path)
        return dict(model.named_parameters())

    for rank in range(world_size):
        ours, theirs = (load(path, rank) for path in checkpoints)
        assert ours.keys() == theirs.keys()
        for name, param in ours.items():
            assert torch.equal(param, theirs[name]), name


def test_mxfp4_loads_off_the_cpu_and_logs_its_dense_experts(
    checkpoints: tuple[Path, Path],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model on another device (meta here, CUDA in tests/gpu) is built and loaded, not
    refused: the loader dequantizes each projection on the CPU, where it read the tensors,
    and the weight loader copies it to the parameter's device. The start-up log says what
    the dense experts cost."""
    from pagedinfer.adapters.models import loader

    dequantized_on: list[torch.device] = []

    def spy(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        dequantized_on.append(blocks.device)
        return dequantize_mxfp4(blocks, scales, dtype)

    monkeypatch.setattr(loader, "dequantize_mxfp4", spy)
    caplog.set_level(logging.INFO, logger="pagedinfer.adapters.models.gpt_oss")
    config = read_model_config(checkpoints[0])
    model = build_model(
        config,
        parallel=OneRank(rank=0, world_size=1),
        backend=create_backend("torch", 16),
        device=torch.device("meta"),
        dtype=torch.bfloat16,
    )
    load_weights(model, checkpoints[0])
    assert dequantized_on == [torch.device("cpu")] * (2 * config.num_hidden_layers)
    experts = [p for name, p in model.named_parameters() if ".experts." in name]
    assert experts and all(p.device.type == "meta" for p in experts)
    size = sum(p.numel() * 2 for p in experts) / 2**30
    [record] = [r for r in caplog.records if "MXFP4" in r.getMessage()]
    assert "dequantized at load to bfloat16 on meta" in record.getMessage()
    assert f"{size:.2f} GiB of dense experts" in record.getMessage()


def test_mxfp4_is_refused_for_other_architectures(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    target = tmp_path / "llama"
    shutil.copytree(make_checkpoint("tiny"), target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="only for GptOssForCausalLM"):
        ModelConfig.from_pretrained(target)


def test_a_blocks_tensor_without_its_scales_is_refused(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    target = tmp_path / "half"
    shutil.copytree(checkpoints[0], target)
    [file] = sorted(target.glob("*.safetensors"))
    tensors = load_file(str(file))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"down_proj_blocks.*other half"):
        Engine(target, device="cpu", dtype="float32", kv_block_size=16)
