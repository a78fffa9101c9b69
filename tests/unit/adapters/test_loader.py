"""Weight loading: packed projections, tied heads, dtype conversion and every refusal."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend
from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS
from pagedinfer.adapters.models.base import CausalLM
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.loader import load_weights
from pagedinfer.adapters.models.registry import build_model
from pagedinfer.errors import UnsupportedModelError

LAYER0 = "model.layers.0"


def build(path: Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    return build_model(
        ModelConfig.from_pretrained(path),
        parallel=SINGLE_PROCESS,
        backend=TorchAttentionBackend(16),
        device=torch.device("cpu"),
        dtype=dtype,
    )


def edited_copy(
    source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]
) -> Path:
    """A copy of checkpoint ``source`` whose tensors went through ``edit``."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_packed_projections_hold_the_checkpoint_tensors(tiny_checkpoint: Path) -> None:
    model = build(tiny_checkpoint)
    load_weights(model, tiny_checkpoint)
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    params = dict(model.named_parameters())
    qkv = params[f"{LAYER0}.self_attn.qkv_proj.weight"]
    expected_qkv = torch.cat(
        [tensors[f"{LAYER0}.self_attn.{name}_proj.weight"] for name in ("q", "k", "v")]
    )
    assert torch.equal(qkv, expected_qkv)
    gate_up = params[f"{LAYER0}.mlp.gate_up_proj.weight"]
    expected_gate_up = torch.cat(
        [tensors[f"{LAYER0}.mlp.{name}_proj.weight"] for name in ("gate", "up")]
    )
    assert torch.equal(gate_up, expected_gate_up)
    assert torch.equal(params["model.norm.weight"], tensors["model.norm.weight"])


def test_tied_head_shares_the_embedding(tiny_checkpoint: Path) -> None:
    model = build(tiny_checkpoint)
    load_weights(model, tiny_checkpoint)
    head = model.get_parameter("lm_head.weight")
    embedding = model.get_parameter("model.embed_tokens.weight")
    assert head is embedding


def test_untied_head_loads_its_own_weight(make_checkpoint: Callable[..., Path]) -> None:
    path = make_checkpoint("tiny", tie_word_embeddings=False)
    model = build(path)
    load_weights(model, path)
    tensors = load_file(str(path / "model.safetensors"))
    assert torch.equal(model.get_parameter("lm_head.weight"), tensors["lm_head.weight"])
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_tied_checkpoint_that_also_stores_lm_head_loads(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    def add_head(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    path = edited_copy(tiny_checkpoint, tmp_path / "with-head", add_head)
    load_weights(build(path), path)


def test_weights_are_converted_to_the_model_dtype(tiny_checkpoint: Path) -> None:
    model = build(tiny_checkpoint, torch.bfloat16)
    load_weights(model, tiny_checkpoint)
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    embedding = model.get_parameter("model.embed_tokens.weight")
    assert embedding.dtype is torch.bfloat16
    assert torch.equal(embedding, tensors["model.embed_tokens.weight"].to(torch.bfloat16))
    # The rotary tables stay float32 whatever the model dtype.
    assert model.get_buffer("model.rotary_emb.cos").dtype is torch.float32


def test_no_safetensors(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "no-weights"
    path.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", path / "config.json")
    with pytest.raises(UnsupportedModelError, match=r"no-weights.*safetensors") as info:
        load_weights(build(path), path)
    assert isinstance(info.value, ValueError)


def test_missing_weight_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    name = f"{LAYER0}.self_attn.k_proj.weight"

    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]

    path = edited_copy(tiny_checkpoint, tmp_path / "missing", drop)
    with pytest.raises(UnsupportedModelError, match="missing") as info:
        load_weights(build(path), path)
    assert name in str(info.value)


def test_missing_untied_head_is_named(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    source = make_checkpoint("tiny", tie_word_embeddings=False)

    def drop_head(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["lm_head.weight"]

    path = edited_copy(source, tmp_path / "no-head", drop_head)
    with pytest.raises(UnsupportedModelError, match=r"lm_head\.weight"):
        load_weights(build(path), path)


def test_unknown_weight_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    def add_unknown(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{LAYER0}.mlp.extra_proj.weight"] = torch.zeros(2, 2)

    path = edited_copy(tiny_checkpoint, tmp_path / "unknown", add_unknown)
    with pytest.raises(UnsupportedModelError, match="extra_proj") as info:
        load_weights(build(path), path)
    assert "unknown" in str(info.value)  # the checkpoint path


def test_wrong_shape_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    name = "model.norm.weight"

    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:10].clone()

    path = edited_copy(tiny_checkpoint, tmp_path / "shape", shrink)
    with pytest.raises(UnsupportedModelError, match=name):
        load_weights(build(path), path)
