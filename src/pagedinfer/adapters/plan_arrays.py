"""A ``BatchPlan`` field (an ``array.array`` of machine integers) as a tensor, in one copy."""

from __future__ import annotations

from array import array

import torch

__all__ = ["plan_tensor"]


def plan_tensor(values: array[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``, without a Python-level loop.

    On the CPU the tensor is a view of the array's bytes (no copy: a plan's arrays are
    read-only, and the tensor keeps the array alive); elsewhere it is one copy of them.
    ``dtype`` must have the array's item size (int64 for ``"q"`` fields, int32 for ``"i"``
    fields; see ``domain/plan.py``).
    """
    assert values.itemsize == dtype.itemsize, (values.typecode, dtype)
    if not values:  # frombuffer refuses empty buffers
        return torch.empty(0, dtype=dtype, device=device)
    view = torch.frombuffer(values, dtype=dtype)
    return view if device.type == "cpu" else view.to(device)
