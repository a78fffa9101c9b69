"""Kernel tests run on CPU in Triton's interpreter, or compiled on CUDA when there is a GPU.

``TRITON_INTERPRET`` must be set before the kernel modules are imported (``triton.jit``
decides at decoration time). Like the root conftest, this sets it only on machines without
CUDA, so a GPU session is never switched to the interpreter behind the GPU tests' back. The
``device`` fixture follows whatever the kernels ended up as.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
