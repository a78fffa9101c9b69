"""Where and in which precision the engine runs: ``device`` and ``dtype`` resolved."""

from __future__ import annotations

import torch

from pagedinfer.errors import ConfigurationError

__all__ = ["resolve_device", "resolve_dtype"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(requested: str | torch.device) -> torch.device:
    """``"auto"`` picks CUDA when available, else the CPU."""
    if isinstance(requested, str) and requested == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else (torch.device("cpu"))
        )
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError) as error:
        raise ConfigurationError(
            f"device={requested!r} is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'."
        ) from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigurationError(
                f"device={requested!r} was requested but CUDA is not available; "
                "use 'cpu' or 'auto'."
            )
        return torch.device("cuda", device.index if device.index is not None else 0)
    if device.type != "cpu":
        raise ConfigurationError(f"device={requested!r} is not supported: use 'cpu' or 'cuda'.")
    return device


def resolve_dtype(
    requested: str | torch.dtype, device: torch.device, checkpoint_dtype: torch.dtype
) -> torch.dtype:
    """``"auto"``: the checkpoint's dtype on CUDA, float32 on the CPU."""
    if isinstance(requested, torch.dtype):
        dtype = requested
    elif requested == "auto":
        return checkpoint_dtype if device.type == "cuda" else torch.float32
    elif isinstance(requested, str) and requested in _DTYPES:
        dtype = _DTYPES[requested]
    else:
        raise ConfigurationError(
            f"dtype={requested!r} is not supported: use 'auto', 'float32', 'float16' or 'bfloat16'."
        )
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigurationError(
            f"dtype={dtype} is not supported: use float32, float16 or bfloat16."
        )
    return dtype
