"""Tiny GPT-OSS checkpoints in MXFP4, as the released ones store their experts, for the tests.

:func:`write_mxfp4_pair` quantizes a dense tiny GPT-OSS's expert projections (nearest FP4
E2M1 value per group of 32 input features, a power-of-two E8M0 scale per group) into
``<proj>_blocks`` / ``<proj>_scales`` with ``quantization_config`` ``{"quant_method":
"mxfp4", ...}``, beside a dense copy whose experts hold transformers' dequantization of them
(the reference model).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pagedinfer.adapters.quantization.mxfp4 import FP4_E2M1_VALUES

__all__ = ["GPT_OSS", "MXFP4_CONFIG", "PROJECTIONS", "quantize_mxfp4", "write_mxfp4_pair"]

GPT_OSS: dict[str, Any] = {
    "architecture": "GptOssForCausalLM",
    "layer_types": ("sliding_attention", "full_attention"),
    "sliding_window": 8,
    "attention_bias": True,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 64,
    "tie_word_embeddings": False,
    "vocab_size": 256,
}
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
PROJECTIONS = ("gate_up_proj", "down_proj")


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[E, K, N]`` -> ``blocks [E, N, K / 32, 16]``, ``scales [E, N, K / 32]``."""
    experts, features, rows = weight.shape
    groups = weight.float().transpose(1, 2).reshape(experts, rows, features // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.pow(2.0, exponent).unsqueeze(-1)
    table = torch.tensor(FP4_E2M1_VALUES[:8])
    nearest = (scaled.abs().unsqueeze(-1) - table).abs().argmin(dim=-1)
    codes = (nearest | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def write_mxfp4_pair(dense: Path, mxfp4: Path, reference: Path) -> None:
    """``mxfp4``: ``dense`` with quantized experts; ``reference``: ``dense`` with the experts
    replaced by their dequantized values (transformers' dequantizer)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    for target in (mxfp4, reference):
        shutil.copytree(dense, target)
    [file] = sorted(dense.glob("*.safetensors"))
    tensors = load_file(str(file))
    quantized, dequantized = dict(tensors), dict(tensors)
    for name, tensor in tensors.items():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            blocks, scales = quantize_mxfp4(tensor)
            del quantized[name]
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=tensor.dtype)
    save_file(quantized, str(mxfp4 / file.name), metadata={"format": "pt"})
    save_file(dequantized, str(reference / file.name), metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (mxfp4 / "config.json").write_text(json.dumps(config))
