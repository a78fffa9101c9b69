"""Attention backends behind one protocol, and the choice between them.

``torch`` (reference, any device), ``triton`` (own kernels; CUDA, or CPU under
``TRITON_INTERPRET=1``), ``flash`` (flash-attn; CUDA, block sizes that are multiples of 256,
no FP8 KV cache). The Triton and flash modules are imported only when chosen.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from pagedinfer.adapters.attention.base import AttentionBackend, AttentionMetadata
from pagedinfer.errors import ConfigurationError

__all__ = [
    "BACKEND_NAMES",
    "FLASH_BLOCK_SIZE_MULTIPLE",
    "AttentionBackend",
    "AttentionMetadata",
    "create_backend",
    "flash_attn_available",
    "resolve_backend_name",
]

BACKEND_NAMES: tuple[str, ...] = ("auto", "torch", "triton", "flash")
# flash-attn's paged kernels need pages of a multiple of this many tokens.
FLASH_BLOCK_SIZE_MULTIPLE = 256


def flash_attn_available() -> bool:
    """True when ``flash_attn`` imports (a broken build counts as absent)."""
    try:
        importlib.import_module("flash_attn")
    except Exception:  # ImportError, or an ABI mismatch surfacing as OSError/RuntimeError
        return False
    return True


def _triton_usable_on(device: torch.device) -> bool:
    # triton is not a dependency of a CPU install (torch's CUDA wheels bring it on Linux).
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend_name(
    requested: str,
    device: torch.device,
    *,
    block_size: int | None = None,
    kv_cache_dtype: str = "auto",
) -> str:
    """``"auto"`` -> the fastest backend for ``device``; explicit names are checked.

    ``auto``: on CUDA ``flash`` if flash-attn imports (and ``block_size``, when given, is a
    multiple of 256, and the KV cache is not FP8), else ``triton``; on CPU ``torch``. Raises
    :class:`ConfigurationError` for unknown names, for backends that cannot run on ``device``
    and for ``flash`` with an FP8 ``kv_cache_dtype``.
    """
    if requested not in BACKEND_NAMES:
        raise ConfigurationError(
            f"attention_backend={requested!r} is unknown: expected one of "
            f"{', '.join(repr(name) for name in BACKEND_NAMES)}."
        )
    if requested == "auto":
        if device.type != "cuda":
            return "torch"
        flash_fits = block_size is None or block_size % FLASH_BLOCK_SIZE_MULTIPLE == 0
        if flash_fits and kv_cache_dtype == "auto" and flash_attn_available():
            return "flash"
        return "triton" if _triton_usable_on(device) else "torch"
    if requested == "flash" and kv_cache_dtype != "auto":
        raise ConfigurationError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported by attention_backend='flash': "
            "flash-attn reads the KV cache in the model's dtype. Use attention_backend='triton' "
            "(or 'auto', which picks it for an FP8 KV cache), or kv_cache_dtype='auto'."
        )
    if requested == "flash" and (device.type != "cuda" or not flash_attn_available()):
        raise ConfigurationError(
            f"attention_backend='flash' needs a CUDA device and an importable flash-attn "
            f"package (device is {device}). Install flash-attn or use attention_backend='auto'."
        )
    if requested == "triton" and not _triton_usable_on(device):
        raise ConfigurationError(
            f"attention_backend='triton' needs triton installed (torch's CUDA wheels bring it; "
            f"`pip install triton` otherwise) and a CUDA device, or TRITON_INTERPRET=1 on CPU "
            f"(device is {device}). Use attention_backend='auto'."
        )
    return requested


def create_backend(name: str, block_size: int, *, kv_cache_dtype: str = "auto") -> AttentionBackend:
    """Instantiate a resolved backend (``torch``, ``triton`` or ``flash``) for ``block_size``.

    Backends refuse block sizes (and ``flash`` an FP8 ``kv_cache_dtype``) they cannot serve
    with a :class:`ConfigurationError`.
    """
    if name == "torch":
        from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend(block_size)
    if name == "triton":
        triton_module = importlib.import_module("pagedinfer.adapters.attention.triton")
        backend: AttentionBackend = triton_module.TritonAttentionBackend(block_size)
        return backend
    if name == "flash":
        flash_module = importlib.import_module("pagedinfer.adapters.attention.flash")
        backend = flash_module.FlashAttentionBackend(block_size, kv_cache_dtype=kv_cache_dtype)
        return backend
    raise ConfigurationError(
        f"attention backend {name!r} is unknown: expected 'torch', 'triton' or 'flash' "
        "(resolve 'auto' with resolve_backend_name first)."
    )
