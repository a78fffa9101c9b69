"""Read a LoRA adapter in PEFT's layout and check it against the model it adapts.

A PEFT adapter is a directory with ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``, ...) and ``adapter_model.safetensors`` whose tensors are
named ``base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight``
(``lora_A``: ``[r, in_features]``, ``lora_B``: ``[out_features, r]``). The adapted output is
``W x + scaling * B (A x)`` with ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``).

Served targets: the attention's ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and the dense
MLP's ``gate_proj``, ``up_proj``, ``down_proj`` (the first three and the next two map onto
the packed ``qkv_proj`` and ``gate_up_proj``). Embedding and LM-head adapters, DoRA, trained
biases, ``modules_to_save`` and per-module ranks are refused by name, with
:class:`~pagedinfer.errors.InvalidLoRAAdapterError`, as is anything else that does not fit.
:func:`check_adapter` reads only the file's header (names and shapes); :func:`load_adapter`
reads the tensors too.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.errors import InvalidLoRAAdapterError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "TARGET_MODULES",
    "AdapterHeader",
    "AdapterWeights",
    "check_adapter",
    "load_adapter",
    "target_shapes",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""The modules an adapter may target, as PEFT names them."""

_REFUSED_MODULES = ("embed_tokens", "lm_head")
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_PARENT = {name: "self_attn" for name in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
    name: "mlp" for name in ("gate_proj", "up_proj", "down_proj")
}


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each target module of ``config``'s model (whole,
    not split across tensor-parallel ranks). A mixture-of-experts model has no dense MLP:
    only the attention's modules."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    shapes = {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
    }
    if config.moe is None:
        inter = config.intermediate_size
        shapes |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter)}
        shapes["down_proj"] = (inter, hidden)
    return shapes


@dataclass(frozen=True, slots=True)
class AdapterHeader:
    """What :func:`check_adapter` found: the rank, the scaling and the adapted modules, as
    ``(layer, module)`` pairs."""

    path: Path
    rank: int
    scaling: float
    modules: frozenset[tuple[int, str]]


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """An adapter's tensors on the host, in float32: ``(A [r, in], B [out, r])`` per
    ``(layer, module)``; ``scaling`` is not folded in."""

    header: AdapterHeader
    tensors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def check_adapter(path: str | Path, config: ModelConfig, max_lora_rank: int) -> AdapterHeader:
    """Check the adapter at ``path`` for ``config``'s model (the header only: names and
    shapes); raise :class:`InvalidLoRAAdapterError` saying what is wrong."""
    directory = Path(path)
    settings = _read_config(directory)
    rank = _rank(settings, directory, max_lora_rank)
    shapes = _header_shapes(directory)
    modules = _check_tensors(shapes, directory, config, rank)
    return AdapterHeader(directory, rank, _scaling(settings, rank, directory), modules)


def load_adapter(path: str | Path, config: ModelConfig, max_lora_rank: int) -> AdapterWeights:
    """:func:`check_adapter`, then the tensors (float32, on the host)."""
    header = check_adapter(path, config, max_lora_rank)
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    prefix = "base_model.model.model.layers"
    with safe_open(str(header.path / ADAPTER_WEIGHTS), framework="pt") as weights:
        for layer, module in sorted(header.modules):
            name = f"{prefix}.{layer}.{_PARENT[module]}.{module}"
            a = weights.get_tensor(f"{name}.lora_A.weight").float()
            b = weights.get_tensor(f"{name}.lora_B.weight").float()
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise InvalidLoRAAdapterError(
                    f"LoRA adapter {header.path}: {name} holds NaN or infinite values."
                )
            tensors[layer, module] = (a, b)
    return AdapterWeights(header, tensors)


def _read_config(directory: Path) -> dict[str, Any]:
    config_path = directory / ADAPTER_CONFIG
    if not directory.is_dir():
        raise InvalidLoRAAdapterError(
            f"LoRA adapter {directory}: no such directory. lora_path must be a directory in "
            f"PEFT's layout ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})."
        )
    for required in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / required).is_file():
            raise InvalidLoRAAdapterError(
                f"LoRA adapter {directory}: {required} is missing. A PEFT adapter directory "
                f"holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (peft's save_pretrained; "
                "pickled adapter_model.bin files are not read)."
            )
    try:
        settings = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise InvalidLoRAAdapterError(
            f"LoRA adapter {directory}: {ADAPTER_CONFIG} is not valid JSON ({error})."
        ) from error
    if not isinstance(settings, dict):
        raise InvalidLoRAAdapterError(
            f"LoRA adapter {directory}: {ADAPTER_CONFIG} must hold a JSON object."
        )
    peft_type = settings.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise InvalidLoRAAdapterError(
            f"LoRA adapter {directory}: peft_type={peft_type!r}; only LORA adapters are served."
        )
    refused = {
        "use_dora": "DoRA adapters",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters",
    }
    for key, what in refused.items():
        if settings.get(key):
            raise InvalidLoRAAdapterError(
                f"LoRA adapter {directory}: {key}=true; {what} are not supported."
            )
    if settings.get("bias", "none") != "none":
        raise InvalidLoRAAdapterError(
            f"LoRA adapter {directory}: bias={settings['bias']!r}; adapters with trained "
            "biases are not supported (bias='none' only)."
        )
    to_save = settings.get("modules_to_save")
    if to_save:
        raise InvalidLoRAAdapterError(
            f"LoRA adapter {directory}: modules_to_save={to_save!r}; adapters that retrain "
            "whole modules are not supported."
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if settings.get(key):
            raise InvalidLoRAAdapterError(
                f"LoRA adapter {directory}: {key} is set; per-module ranks and alphas are "
                "not supported (one r and lora_alpha for every module)."
            )
    targets = settings.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    for name in names:
        for refused_module in _REFUSED_MODULES:
            if isinstance(name, str) and name.split(".")[-1] == refused_module:
                raise InvalidLoRAAdapterError(
                    f"LoRA adapter {directory}: target module {refused_module!r} is not "
                    f"supported (embedding and LM-head adapters); served targets: "
                    f"{', '.join(TARGET_MODULES)}."
                )
    return settings


def _rank(settings: Mapping[str, Any], directory: Path, max_lora_rank: int) -> int:
    rank = settings.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidLoRAAdapterError(
            f"LoRA adapter {directory}: r={rank!r} in {ADAPTER_CONFIG} is not a rank >= 1."
        )
    if rank > max_lora_rank:
        raise InvalidLoRAAdapterError(
            f"LoRA adapter {directory}: rank {rank} exceeds max_lora_rank={max_lora_rank}. "
            "Start the engine with a larger max_lora_rank."
        )
    return rank


def _scaling(settings: Mapping[str, Any], rank: int, directory: Path) -> float:
    alpha = settings.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise InvalidLoRAAdapterError(
            f"LoRA adapter {directory}: lora_alpha={alpha!r} is not a finite number."
        )
    if settings.get("use_rslora"):
        return float(alpha) / math.sqrt(rank)
    return float(alpha) / rank


def _header_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    try:
        with safe_open(str(directory / ADAPTER_WEIGHTS), framework="pt") as weights:
            return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118
    except Exception as error:  # safetensors raises its own error types
        raise InvalidLoRAAdapterError(
            f"LoRA adapter {directory}: {ADAPTER_WEIGHTS} cannot be read ({error})."
        ) from error


def _check_tensors(
    shapes: Mapping[str, tuple[int, ...]], directory: Path, config: ModelConfig, rank: int
) -> frozenset[tuple[int, str]]:
    expected = target_shapes(config)
    halves: dict[tuple[int, str], set[str]] = {}
    for name, shape in shapes.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            for refused in _REFUSED_MODULES:
                if refused in name:
                    raise InvalidLoRAAdapterError(
                        f"LoRA adapter {directory}: {name} adapts {refused!r}, which is not "
                        f"supported (embedding and LM-head adapters); served targets: "
                        f"{', '.join(TARGET_MODULES)}."
                    )
            raise InvalidLoRAAdapterError(
                f"LoRA adapter {directory}: tensor {name!r} is not a LoRA weight of a served "
                f"module (base_model.model.model.layers.<i>.<self_attn|mlp>.<module>."
                f"lora_<A|B>.weight with module one of {', '.join(TARGET_MODULES)})."
            )
        layer, parent, module, half = int(match[1]), match[2], match[3], match[4]
        if module not in expected or _PARENT.get(module) != parent:
            allowed = ", ".join(name for name in TARGET_MODULES if name in expected)
            raise InvalidLoRAAdapterError(
                f"LoRA adapter {directory}: target module {parent}.{module} (tensor {name}) "
                f"is not supported for this model; served targets: {allowed}."
            )
        if layer >= config.num_hidden_layers:
            raise InvalidLoRAAdapterError(
                f"LoRA adapter {directory}: tensor {name} adapts layer {layer}, but the model "
                f"has {config.num_hidden_layers} layers: the adapter is for another model."
            )
        in_features, out_features = expected[module]
        want = (rank, in_features) if half == "A" else (out_features, rank)
        if shape != want:
            raise InvalidLoRAAdapterError(
                f"LoRA adapter {directory}: tensor {name} has shape {list(shape)}, expected "
                f"{list(want)} (r={rank}, {module} maps {in_features} -> {out_features} "
                "features): the adapter is for another model, or r does not match its tensors."
            )
        halves.setdefault((layer, module), set()).add(half)
    for (layer, module), found in halves.items():
        if found != {"A", "B"}:
            missing = "lora_B" if "A" in found else "lora_A"
            raise InvalidLoRAAdapterError(
                f"LoRA adapter {directory}: layer {layer}'s {module} has no {missing} weight."
            )
    if not halves:
        raise InvalidLoRAAdapterError(f"LoRA adapter {directory}: it holds no LoRA weights.")
    return frozenset(halves)
