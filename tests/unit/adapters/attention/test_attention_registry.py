"""Choosing and creating attention backends."""

from __future__ import annotations

import sys

import pytest
import torch

import pagedinfer.adapters.attention as attention
from pagedinfer.adapters.attention import BACKEND_NAMES, create_backend, resolve_backend_name
from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend
from pagedinfer.errors import ConfigurationError

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)  # a device object; no GPU is touched


def test_auto_on_cpu_is_torch() -> None:
    assert resolve_backend_name("auto", CPU) == "torch"
    assert resolve_backend_name("torch", CPU) == "torch"


def test_unknown_name_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigurationError, match="'flashinfer'") as info:
        resolve_backend_name("flashinfer", CPU)
    assert isinstance(info.value, ValueError)
    for name in BACKEND_NAMES:
        assert repr(name) in str(info.value)


@pytest.mark.parametrize(
    ("flash", "block_size", "expected"),
    [
        (True, None, "flash"),
        (True, 256, "flash"),
        (True, 512, "flash"),
        (True, 16, "triton"),
        (False, 256, "triton"),
    ],
)
def test_auto_on_cuda(
    monkeypatch: pytest.MonkeyPatch, flash: bool, block_size: int | None, expected: str
) -> None:
    monkeypatch.setattr(attention, "flash_attn_available", lambda: flash)
    assert resolve_backend_name("auto", CUDA, block_size=block_size) == expected


def test_flash_needs_cuda_and_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    with pytest.raises(ConfigurationError, match="CUDA"):
        resolve_backend_name("flash", CPU)
    assert resolve_backend_name("flash", CUDA) == "flash"
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    with pytest.raises(ConfigurationError, match="flash-attn"):
        resolve_backend_name("flash", CUDA)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend_name("triton", CPU) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigurationError, match="TRITON_INTERPRET"):
        resolve_backend_name("triton", CPU)


def test_triton_needs_triton_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU install has no triton: asking for its backend is a ConfigurationError that says
    to install it, not a ModuleNotFoundError from inside the engine."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", None)  # find_spec -> None, import fails
    with pytest.raises(ConfigurationError, match="needs triton installed"):
        resolve_backend_name("triton", CPU)
    assert resolve_backend_name("auto", CPU) == "torch"


def test_create_torch_backend() -> None:
    backend = create_backend("torch", 32)
    assert isinstance(backend, TorchAttentionBackend)
    assert backend.name == "torch" and backend.block_size == 32


@pytest.mark.parametrize("name", ["auto", "nope"])
def test_create_refuses_unresolved_or_unknown_names(name: str) -> None:
    with pytest.raises(ConfigurationError, match=repr(name)):
        create_backend(name, 16)
