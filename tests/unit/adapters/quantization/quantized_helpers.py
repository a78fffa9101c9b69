"""Quantized checkpoints for the tests: a small random model written in each format.

The base model has sizes that exercise the formats' edges: ``hidden_size`` 192 is 1.5
blocks of 128 (partial FP8 blocks along K for q/k/v and gate/up, along N for o and down),
q/k/v heads of 64 features (k and v are one 128-block each), groups of 64 for the 4-bit
formats. Each case names the format's options; ``quantized_pair`` writes the quantized
checkpoint and its dequantized float32 reference once per session.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pagedinfer.adapters.models.quantized_checkpoint import QuantFormat, write_quantized_checkpoint

BASE: dict[str, Any] = {
    "hidden_size": 192,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


@dataclass(frozen=True)
class Case:
    fmt: QuantFormat
    options: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)  # overrides of BASE


CASES: dict[str, Case] = {
    # Qwen3-*-FP8: 128x128 blocks, partial ones at the edges; one module left dense.
    "fp8-block128": Case("fp8", {"block": (128, 128), "skip": ("model.layers.1.mlp.down_proj",)}),
    "fp8-block64": Case("fp8", {"block": (64, 64)}),
    # llm-compressor FP8_DYNAMIC: one scale per output channel (Llama, untied head).
    "ct-channel": Case(
        "compressed-tensors",
        {"block": None},
        {"architecture": "LlamaForCausalLM", "tie_word_embeddings": False},
    ),
    "ct-block64": Case("compressed-tensors", {"block": (64, 64)}),
    # AutoAWQ GEMM on a Qwen2 model (q/k/v biases stay dense beside the packed weights).
    "awq-g64": Case("awq", {"group_size": 64}, {"architecture": "Qwen2ForCausalLM"}),
    "gptq-g64": Case("gptq", {"group_size": 64}),
    "gptq-act-order": Case("gptq", {"group_size": 64, "desc_act": True}),
    "gptq-asym-one-group": Case("gptq", {"group_size": -1, "sym": False}),
}


def make_quantized_factory(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, Path]]:
    """``make(case) -> (quantized checkpoint, dequantized reference)``, each written once."""
    built: dict[str, tuple[Path, Path]] = {}

    def make(name: str) -> tuple[Path, Path]:
        if name not in built:
            case = CASES[name]
            source = make_checkpoint("tiny", **(BASE | case.model))
            root = tmp_path_factory.mktemp(f"quantized-{name}")
            quantized = write_quantized_checkpoint(
                source, root / "quantized", case.fmt, reference=root / "reference", **case.options
            )
            built[name] = (quantized, root / "reference")
        return built[name]

    return make
