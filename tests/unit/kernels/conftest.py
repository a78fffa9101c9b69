"""Kernel tests run on CPU in Triton's interpreter unless the kernels were already compiled.

``TRITON_INTERPRET`` must be set before the kernel modules are imported (``triton.jit``
decides at decoration time); the root conftest sets it on CPU-only machines and this one
makes sure it is set when these tests are collected first. If an earlier import already
compiled the kernels for a GPU, the tests run on CUDA instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


def kernels_are_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from pagedinfer.adapters.kernels import store_kv

    return isinstance(store_kv._store_kv_kernel, InterpretedFunction)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernel test tensors live: CPU under the interpreter, else CUDA."""
    if kernels_are_interpreted():
        return torch.device("cpu")
    if not torch.cuda.is_available():  # pragma: no cover - compiled kernels need a GPU
        pytest.skip("Triton kernels are compiled but no CUDA device is available")
    return torch.device("cuda")
