"""``config.json``'s ``quantization_config`` -> the method's parsed config, or a refusal."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pagedinfer.adapters.quantization.awq import AwqConfig
from pagedinfer.adapters.quantization.base import QuantizationConfig
from pagedinfer.adapters.quantization.compressed_tensors import CompressedTensorsFp8Config
from pagedinfer.adapters.quantization.fp8_block import Fp8BlockConfig
from pagedinfer.adapters.quantization.gptq import GptqConfig
from pagedinfer.adapters.quantization.mxfp4 import Mxfp4Config
from pagedinfer.errors import UnsupportedModelError

__all__ = ["SUPPORTED_METHODS", "parse_quantization_config"]

_PARSERS: dict[str, Callable[[Mapping[str, Any], Path], QuantizationConfig]] = {
    "fp8": Fp8BlockConfig.from_dict,
    "compressed-tensors": CompressedTensorsFp8Config.from_dict,
    "awq": AwqConfig.from_dict,
    "gptq": GptqConfig.from_dict,
    "mxfp4": Mxfp4Config.from_dict,
}
SUPPORTED_METHODS: tuple[str, ...] = tuple(_PARSERS)


def parse_quantization_config(
    raw: object, path: Path, architecture: str | None = None
) -> QuantizationConfig | None:
    """``None`` for an unquantized checkpoint (no ``quantization_config``), else the parsed
    config. Raises :class:`UnsupportedModelError` naming the method or the field that is not
    supported, or an ``architecture`` the method has no path for (MXFP4 is GPT-OSS's)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise UnsupportedModelError(
            f"checkpoint {str(path)!r}: quantization_config={raw!r} is invalid: expected an "
            "object with a quant_method."
        )
    method = raw.get("quant_method")
    parser = _PARSERS.get(method) if isinstance(method, str) else None
    if parser is None:
        raise UnsupportedModelError(
            f"checkpoint {str(path)!r}: quantization_config quant_method={method!r} is not "
            f"supported: expected one of {', '.join(repr(m) for m in SUPPORTED_METHODS)} "
            "(or an unquantized checkpoint)."
        )
    config = parser(raw, path)
    if (
        architecture is not None
        and config.architectures is not None
        and architecture not in config.architectures
    ):
        raise UnsupportedModelError(
            f"checkpoint {str(path)!r}: quantization_config quant_method={method!r} is "
            f"supported only for {', '.join(sorted(config.architectures))}, not "
            f"{architecture}: dequantize the checkpoint first (transformers: load it with "
            "Mxfp4Config(dequantize=True), then save_pretrained)."
        )
    return config
