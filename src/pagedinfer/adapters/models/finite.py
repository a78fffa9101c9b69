"""NaN and infinity in a checkpoint's tensors, found at load with the tensor's name.

A NaN scale or norm weight loads fine and then turns every logit of every request into NaN:
sampling from NaN logits returns garbage (token 0, a token outside ``allowed_token_ids``) with
no error anywhere. So the loader checks each tensor as it reads it, before it reaches a
parameter, and refuses a non-finite one with :class:`~pagedinfer.errors.NonFiniteWeightError`
naming the tensor, the file and how many values are NaN / infinite.

Which tensors (``weight_check``, an engine option; docs/models.md, "Checkpoint checks"):

* ``"default"``: every floating-point tensor but the big matrices: quantization scales
  (GPTQ / AWQ ``scales``, FP8 ``weight_scale`` / ``weight_scale_inv``, KV-cache scales), norm
  weights, biases, and anything else that is not a ``*.weight`` of two dimensions or more.
  Zero points and packed 4-bit weights are integers: they hold no NaN. These are a small
  fraction of the bytes, and the tensors a broken quantizer breaks (one bad scale spoils a
  whole group of weights); checking them is lost in the noise of the load time
  (26 to 46 ms for Qwen3-0.6B's shape; ``benchmarks/load_check.py``, docs/benchmarks.md).
* ``"all"``: every floating-point tensor, the embedding, LM head and projection matrices
  (dense or FP8) too: a second pass over every byte, 2.6 to 4.5 s for Qwen3-0.6B's shape
  on a loaded 2-core CPU, +20 to 80 % of the load time (the same benchmark).
* ``"none"``: nothing.

``pagedinfer check-weights DIR`` scans every tensor of a checkpoint without loading a model
(:mod:`~pagedinfer.adapters.models.checkpoint_scan`).

A tensor's minimum and maximum are finite exactly when all its values are (NaN propagates
through both, an infinity is one of them), so a tensor is read once more by
``torch.aminmax`` (vectorized, ~15x faster than a float32 sum of bfloat16 values), and counted
value by value only when one of the two is not finite. FP8 tensors are read by their bit
patterns (NaN in ``float8_e4m3fn``: ``S.1111.111``; in ``float8_e5m2``: exponent ``11111``
with a non-zero mantissa, infinity with a zero one): the largest magnitude pattern first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from pagedinfer.errors import ConfigurationError, NonFiniteWeightError

__all__ = [
    "WEIGHT_CHECKS",
    "NonFinite",
    "WeightCheck",
    "check_finite",
    "checks_tensor",
    "count_nonfinite",
    "validate_weight_check",
]

WeightCheck = Literal["default", "all", "none"]
WEIGHT_CHECKS: tuple[str, ...] = get_args(WeightCheck)


@dataclass(frozen=True, slots=True)
class NonFinite:
    """How many values of a tensor are NaN and how many are infinite."""

    nan: int = 0
    inf: int = 0

    def __bool__(self) -> bool:
        return bool(self.nan or self.inf)

    def describe(self, numel: int) -> str:
        parts = [f"{count} {kind}" for count, kind in ((self.nan, "NaN"), (self.inf, "infinite"))]
        return f"{' and '.join(p for p in parts if not p.startswith('0 '))} of {numel} values"


def validate_weight_check(value: object) -> WeightCheck:
    """``value`` if it names a :data:`WeightCheck`; else :class:`ConfigurationError`."""
    if value not in WEIGHT_CHECKS:
        raise ConfigurationError(
            f"weight_check={value!r} is unknown: choose 'default' (scales, norms, biases: "
            "every tensor but the big weight matrices), 'all' (every tensor, slower loads) "
            "or 'none'."
        )
    return value  # type: ignore[return-value]


def checks_tensor(name: str, tensor: torch.Tensor, check: WeightCheck) -> bool:
    """Whether ``check`` looks at the tensor ``name`` (see the module docstring)."""
    if check == "none" or not tensor.is_floating_point():
        return False
    if check == "all":
        return True
    return tensor.dim() < 2 or not name.endswith(".weight")


def count_nonfinite(tensor: torch.Tensor) -> NonFinite:
    """The NaN and infinite values of a floating-point ``tensor`` (any device, any float
    dtype, FP8 included)."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return NonFinite()
    if tensor.element_size() == 1:
        return _count_fp8(tensor)
    low, high = torch.aminmax(tensor)  # NaN propagates; an infinity is an extreme
    if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
        return NonFinite()
    return NonFinite(int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum()))


def check_finite(name: str, tensor: torch.Tensor, where: str) -> None:
    """Raise :class:`NonFiniteWeightError` naming ``name`` (``where``: the checkpoint and
    file, for the message) when ``tensor`` holds a NaN or an infinity."""
    found = count_nonfinite(tensor)
    if found:
        raise NonFiniteWeightError(
            f"{where}: tensor {name!r} holds {found.describe(tensor.numel())}: the checkpoint "
            "is corrupt (a failed quantization or conversion, or a damaged file); every "
            "output would be NaN. Re-download or re-export it (pagedinfer check-weights DIR "
            "lists every such tensor)."
        )


def _count_fp8(tensor: torch.Tensor) -> NonFinite:
    bits = tensor.contiguous().view(torch.uint8)
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # NaN and infinity have the largest magnitudes' bit patterns: one pass rules them out.
        highest = int((bits & 0x7F).amax())
        if highest < (0x7F if tensor.dtype == torch.float8_e4m3fn else 0x7C):
            return NonFinite()
    if tensor.dtype == torch.float8_e5m2:
        special = (bits & 0x7C) == 0x7C  # exponent all ones
        infinite = special & ((bits & 0x03) == 0)
        return NonFinite(int((special & ~infinite).sum()), int(infinite.sum()))
    if tensor.dtype == torch.float8_e4m3fn:
        return NonFinite(int(((bits & 0x7F) == 0x7F).sum()))
    # The "fnuz" variants: one NaN, the negative zero pattern; no infinity.
    return NonFinite(int((bits == 0x80).sum()))
