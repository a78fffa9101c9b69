"""``pagedinfer quantize``: a dense (bfloat16, float16 or float32) checkpoint written as a
quantized one, in a layout the loader reads (the published tools' layouts:
:mod:`pagedinfer.adapters.models.quantized_checkpoint`).

* ``fp8``: block-wise FP8 as Qwen3-*-FP8 and DeepSeek-V3 publish it (``weight`` in
  ``float8_e4m3``, one float32 ``weight_scale_inv`` per 128×128 block; ``quant_method: fp8``);
  half the bytes of bfloat16 weights, dequantized on the fly.
* ``gptq`` / ``awq``: 4-bit integers packed eight to an int32 (AutoGPTQ v1 / AutoAWQ GEMM),
  one float16 scale (and zero point) per group of ``group_size`` input columns; a quarter of
  the bytes. Round-to-nearest from each group's range, without calibration data, so less
  accurate than GPTQ's or AWQ's own calibrated algorithms: for production 4-bit weights use a
  published checkpoint or those tools.
* ``compressed-tensors``: llm-compressor's FP8_DYNAMIC (one scale per output channel).

The decoder's projections (q, k, v, o, gate, up, down) are quantized; embeddings, norms and
the LM head are copied, and so are the tokenizer and generation config files.
"""

from __future__ import annotations

import os
from pathlib import Path

from pagedinfer.adapters.models.quantized_checkpoint import (
    FORMATS,
    write_quantized_checkpoint,
)
from pagedinfer.adapters.models.registry import read_model_config
from pagedinfer.errors import ConfigurationError

__all__ = ["QUANTIZE_FORMATS", "quantize_checkpoint"]

QUANTIZE_FORMATS = FORMATS


def quantize_checkpoint(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    method: str,
    *,
    group_size: int = 128,
    block: int = 128,
) -> str:
    """Write the dense checkpoint ``source`` quantized with ``method`` (one of
    :data:`QUANTIZE_FORMATS`) to the new directory ``target``; return what the loader reads
    it as (``fp8 (e4m3 weights, 128x128 blocks)``). ``group_size``: the 4-bit methods' input
    columns per scale (-1: one group); ``block``: FP8's scale blocks (``block``×``block``).
    Raises :class:`ConfigurationError` for a method, group size, block or target it cannot
    use, and the loader's errors for a source that is no dense checkpoint."""
    if method not in FORMATS:
        raise ConfigurationError(
            f"quantization method {method!r} is unknown: choose one of {', '.join(FORMATS)}."
        )
    if group_size != -1 and group_size < 1:
        raise ConfigurationError(f"group size {group_size} is invalid: expected >= 1, or -1.")
    model = read_model_config(Path(source))  # CheckpointNotFoundError, UnsupportedModelError
    if model.quantization is not None:
        raise ConfigurationError(
            f"{os.fspath(source)!r} is already quantized ({model.quantization.describe()}): "
            "quantize its dense original."
        )
    if model.moe is not None:
        raise ConfigurationError(
            f"{os.fspath(source)!r} is a mixture of experts ({model.architecture}): its experts "
            "have no quantized path, so it cannot be quantized here."
        )
    out = Path(target)
    if out.exists() and any(out.iterdir()):
        raise ConfigurationError(
            f"{os.fspath(target)!r} is not empty: give a new directory for the quantized "
            "checkpoint."
        )
    in_features = {
        model.hidden_size,
        model.intermediate_size,
        model.num_attention_heads * model.head_dim,
    }
    if method in ("gptq", "awq") and group_size != -1 and any(n % group_size for n in in_features):
        raise ConfigurationError(
            f"group size {group_size} does not divide the projections' input sizes "
            f"{sorted(in_features)}: pass --group-size with a divisor (or -1: one group)."
        )
    outputs = {
        model.num_attention_heads * model.head_dim,
        model.num_key_value_heads * model.head_dim,
        model.intermediate_size,
        model.hidden_size,
    }
    if method == "fp8" and (block < 1 or any(n % block for n in outputs)):
        raise ConfigurationError(
            f"FP8 block {block} does not divide the projections' output sizes {sorted(outputs)}"
            " (the loader splits the fused q/k/v and gate/up weights on block edges): pass "
            "--block with a divisor."
        )
    write_quantized_checkpoint(
        Path(source), out, method, group_size=group_size, block=(block, block)
    )
    written = read_model_config(out).quantization  # what the loader will read
    assert written is not None
    return written.describe()
