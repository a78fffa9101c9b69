"""Quantize a local checkpoint into a published format (tests, benchmarks; no hub needed).

:func:`write_quantized_checkpoint` reads a dense checkpoint (e.g. one of
``random_checkpoint``'s) and writes the same model as the published tools do:

* ``fp8``: Qwen3-*-FP8 / DeepSeek-V3 block-wise FP8 (``weight`` ``F8_E4M3``,
  ``weight_scale_inv`` float32 per ``block``; ``quant_method: fp8``);
* ``compressed-tensors``: llm-compressor's ``FP8_DYNAMIC`` (``weight`` ``F8_E4M3``,
  ``weight_scale [N, 1]`` in the model's dtype; ``format: float-quantized``);
* ``awq``: AutoAWQ GEMM (``qweight [K, N/8]``, ``qzeros``, float16 ``scales``; asymmetric
  min/max quantization with zero points, packed in AWQ's order);
* ``gptq``: AutoGPTQ v1 (``qweight [K/8, N]``, ``qzeros`` stored minus one, float16
  ``scales``, ``g_idx``; symmetric or not, with act-order a shuffled ``g_idx``).

The decoder's projections (q, k, v, o, gate, up, down) are quantized; embeddings, norms and
the LM head are copied. The packing loops are written out as the tools write them
(AutoAWQ's ``order_map``, AutoGPTQ's shifts), independently of the loader's unpacking, so
that a test comparing the two checks the layout and not one function against itself.

With ``reference``, the same model is also written unquantized with the *dequantized*
weights (computed from the integers and scales before they are packed), in float32: an
engine loading the quantized checkpoint must give that reference's outputs.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from pagedinfer.adapters.models.loader import INDEX_FILE, checkpoint_files
from pagedinfer.adapters.quantization.fp8 import dequantize_fp8, quantize_fp8

__all__ = ["FORMATS", "QuantFormat", "quantize_projection", "write_quantized_checkpoint"]

QuantFormat = Literal["fp8", "compressed-tensors", "awq", "gptq"]
FORMATS: tuple[QuantFormat, ...] = ("fp8", "compressed-tensors", "awq", "gptq")

_PROJECTION = re.compile(
    r"^(?P<module>model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj))\.weight$"
)
_SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
_AWQ_ORDER_MAP = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i holds column order_map[i]


def write_quantized_checkpoint(
    source: str | Path,
    target: str | Path,
    fmt: QuantFormat,
    *,
    reference: str | Path | None = None,
    block: tuple[int, int] | None = (128, 128),
    group_size: int = 128,
    desc_act: bool = False,
    sym: bool = True,
    skip: Sequence[str] = (),
    seed: int = 0,
    kv_scales: Sequence[tuple[float, float]] = (),
) -> Path:
    """Write ``source`` quantized in ``fmt`` to ``target`` and return ``target``.

    ``block``: FP8 scale blocks (``fp8``: required; ``compressed-tensors``: None for one
    scale per channel, else ``strategy: block``). ``group_size`` (``-1``: one group),
    ``desc_act`` and ``sym`` are the 4-bit options (AWQ is always asymmetric, no act-order).
    ``skip`` lists projection modules left dense (and named in the format's ignore list;
    not for GPTQ, whose config has none). ``seed`` draws GPTQ's act-order permutation.
    ``kv_scales`` (compressed-tensors only): each layer's FP8 KV-cache ``(k_scale, v_scale)``,
    written as ``self_attn.k_scale`` / ``v_scale`` with a ``kv_cache_scheme``.
    """
    root, out = Path(source), Path(target)
    config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(root):
        tensors.update(load_file(str(file)))
    if fmt == "gptq" and skip:
        raise ValueError("GPTQ checkpoints have no ignore list: skip must be empty")
    if fmt == "awq" and (desc_act or not sym):
        raise ValueError("AWQ is asymmetric (zero points) without act-order")
    if kv_scales and fmt != "compressed-tensors":
        raise ValueError("only compressed-tensors checkpoints declare KV-cache scales")
    quantized: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _PROJECTION.match(name)
        if match is None or match["module"] in skip:
            quantized[name] = tensor
            dense[name] = tensor.float()
            continue
        module = match["module"]
        # Act-order permutes the columns by the input's statistics: modules that read the
        # same input (q/k/v, gate/up) get the same permutation, as GPTQ gives them.
        parent, leaf = module.rsplit(".", 1)
        shared_input = f"{parent}.{_SHARED_INPUT.get(leaf, leaf)}"
        generator = torch.Generator().manual_seed(seed + zlib.crc32(shared_input.encode()))
        parts, dequantized = quantize_projection(
            tensor, fmt, block=block, group_size=group_size, desc_act=desc_act, sym=sym,
            generator=generator,
        )  # fmt: skip
        quantized.update({f"{module}.{suffix}": part for suffix, part in parts.items()})
        dense[name] = dequantized
    quantization = _config(fmt, block, group_size, desc_act, sym, skip)
    for layer, (k_scale, v_scale) in enumerate(kv_scales):
        quantized[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([k_scale])
        quantized[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v_scale])
        quantization["kv_cache_scheme"] = {
            "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
            "strategy": "tensor", "group_size": None, "block_structure": None,
        }  # fmt: skip
    _write(root, out, config | {"quantization_config": quantization}, quantized)
    if reference is not None:
        _write(
            root, Path(reference), config | {"torch_dtype": "float32", "dtype": "float32"}, dense
        )
    return out


def _write(source: Path, target: Path, config: dict[str, Any], tensors: dict[str, Any]) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():  # tokenizer, generation config, ...
        if item.is_file() and item.suffix != ".safetensors" and item.name != INDEX_FILE:
            shutil.copy(item, target / item.name)
    (target / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    save_file(contiguous, str(target / "model.safetensors"), metadata={"format": "pt"})


def _config(
    fmt: QuantFormat,
    block: tuple[int, int] | None,
    group_size: int,
    desc_act: bool,
    sym: bool,
    skip: Sequence[str],
) -> dict[str, Any]:
    if fmt == "fp8":
        assert block is not None, "block-wise FP8 needs a block"
        config: dict[str, Any] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        }
        if skip:
            config["modules_to_not_convert"] = list(skip)
        return config
    if fmt == "compressed-tensors":
        weights: dict[str, Any] = {
            "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
            "strategy": "channel", "group_size": None, "block_structure": None,
            "actorder": None, "observer": "minmax", "observer_kwargs": {},
        }  # fmt: skip
        activations: dict[str, Any] = {
            "num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
            "strategy": "token", "group_size": None, "block_structure": None,
            "actorder": None, "observer": None, "observer_kwargs": {},
        }  # fmt: skip
        if block is not None:
            weights |= {"strategy": "block", "block_structure": list(block)}
            activations |= {"strategy": "group", "group_size": block[1]}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": activations,
                    "output_activations": None,
                    "format": "float-quantized",
                }
            },
            "ignore": ["lm_head", *skip],
            "kv_cache_scheme": None,
            "sparsity_config": {},
            "global_compression_ratio": None,
        }
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": list(skip) or None,
        }
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "damp_percent": 0.01,
        "true_sequential": True,
        "static_groups": False,
        "checkpoint_format": "gptq",
        "model_name_or_path": None,
        "model_file_base_name": None,
    }


def quantize_projection(
    weight: torch.Tensor,
    fmt: QuantFormat,
    *,
    block: tuple[int, int] | None,
    group_size: int,
    desc_act: bool,
    sym: bool,
    generator: torch.Generator,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One projection ``W [N, K]`` in ``fmt``: its checkpoint tensors (by suffix, e.g.
    ``qweight``, ``qzeros``, ``scales``, ``g_idx``) and its dequantized float32 weight,
    computed before packing. Options as in :func:`write_quantized_checkpoint`; ``generator``
    draws GPTQ's act-order permutation."""
    if fmt in ("fp8", "compressed-tensors"):
        scale_dtype = torch.float32 if fmt == "fp8" else weight.dtype
        q, scale = quantize_fp8(weight, block, scale_dtype)
        suffix = "weight_scale_inv" if fmt == "fp8" else "weight_scale"
        return {"weight": q, suffix: scale}, dequantize_fp8(q, scale, block)
    rows, cols = weight.shape  # N output, K input features
    size = cols if group_size == -1 else group_size
    if desc_act:  # act-order: groups follow a permutation of the columns
        order = torch.randperm(cols, generator=generator)
        g_idx = torch.empty(cols, dtype=torch.int32)
        g_idx[order] = torch.arange(cols, dtype=torch.int32) // size
    else:
        g_idx = torch.arange(cols, dtype=torch.int32) // size
    groups = -(-cols // size)
    w = weight.float()
    scales = torch.empty(groups, rows)
    zeros = torch.empty(groups, rows, dtype=torch.int64)
    for g in range(groups):
        columns = w[:, g_idx == g]
        if fmt == "awq":  # AutoAWQ's pseudo_quantize_tensor, zero_point=True
            high, low = columns.amax(dim=1), columns.amin(dim=1)
            scale = ((high - low).clamp(min=1e-5) / 15).half().float()
            zero = (-torch.round(low / scale)).clamp(0, 15)
        else:  # AutoGPTQ's Quantizer.find_params, 4 bits
            low = columns.amin(dim=1).clamp(max=0)
            high = columns.amax(dim=1).clamp(min=0)
            if sym:
                high = torch.maximum(low.abs(), high)
                low = torch.where(low < 0, -high, low)
            empty = (low == 0) & (high == 0)
            low, high = torch.where(empty, -1.0, low), torch.where(empty, 1.0, high)
            scale = ((high - low) / 15).half().float()
            # v1 stores z - 1 in 4 bits: z = 0 cannot be stored (as in AutoGPTQ), so 1..15.
            zero = torch.full_like(scale, 8.0) if sym else torch.round(-low / scale).clamp(1, 15)
        scales[g], zeros[g] = scale, zero.to(torch.int64)
    index = g_idx.long()
    per_column_scale, per_column_zero = scales[index].t(), zeros[index].t()  # [N, K]
    q = torch.clamp(torch.round(w / per_column_scale) + per_column_zero, 0, 15).to(torch.int64)
    dequantized = (q.float() - per_column_zero.float()) * per_column_scale
    intweight, intzeros = q.t().contiguous(), zeros  # [K, N], [groups, N]
    if fmt == "awq":
        return {
            "qweight": _pack_awq(intweight),
            "qzeros": _pack_awq(intzeros),
            "scales": scales.half(),
        }, dequantized
    return {
        "qweight": _pack_gptq_rows(intweight),
        "qzeros": _pack_gptq_columns(intzeros - 1),  # v1 stores zero points minus one
        "scales": scales.half(),
        "g_idx": g_idx,
    }, dequantized


def _int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM packing: ``[R, N]`` -> ``[R, N / 8]``; word ``c`` holds
    columns ``8c + order_map[i]`` in bits ``4i``."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for col in range(cols // 8):
        for i in range(8):
            words[:, col] |= (values[:, col * 8 + _AWQ_ORDER_MAP[i]] & 0xF) << (i * 4)
    return _int32(words)


def _pack_gptq_rows(values: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qweight packing: ``[K, N]`` -> ``[K / 8, N]``; row ``r`` holds input
    features ``8r + j`` in bits ``4j``."""
    rows, cols = values.shape
    words = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for row in range(rows // 8):
        for j in range(8):
            words[row] |= (values[row * 8 + j] & 0xF) << (4 * j)
    return _int32(words)


def _pack_gptq_columns(values: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qzeros packing: ``[G, N]`` -> ``[G, N / 8]``; word ``c`` holds columns
    ``8c + j`` in bits ``4j`` (a zero point of 0 stored minus one wraps to 15, as there)."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for col in range(cols // 8):
        for j in range(8):
            words[:, col] |= (values[:, col * 8 + j] & 0xF) << (4 * j)
    return _int32(words)
