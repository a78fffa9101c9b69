"""New values for a loaded model's weights, in checkpoint (Hugging Face) names.

``Engine.update_weights`` and ``Engine.update_weights_from_path`` come here, on every rank,
through the executor's ``collective_rpc`` (the functions take the rank's runner first). Each
update runs in two phases, and the second starts only when the first passed on every rank:

1. **check** (:func:`check_update`, :func:`check_update_from_path`): every tensor's name,
   dtype and full shape, with the checkpoint loader's own checks
   (:class:`~pagedinfer.adapters.models.loader.TensorLoader`: the name maps to a parameter
   shard through the model's weight mapping (fused q/k/v and gate/up, experts), or is one
   the model ignores (a tied ``lm_head.weight``, another pipeline stage's tensors); its dtype
   is one its parameter accepts; its shape is the one config.json implies; no tensor twice)
   plus, on the driver, the values ``weight_check`` names (:func:`check_update_values`).
   A refusal raises :class:`~pagedinfer.errors.WeightUpdateError` and nothing was written.
2. **write** (:func:`write_update`, :func:`write_update_from_path`): each tensor's rank
   shard is copied *in place* into its parameter by the parameter's ``weight_loader`` (the
   same code that loaded the checkpoint: tensor-parallel slicing, packed shards, dtype
   conversion). In place, so CUDA graphs captured on the parameters stay valid, and no
   second copy of the model is ever made.

Layers of a quantized checkpoint (``quantization_config``) are refused in phase 1: once
loaded they hold a dequantized weight or a GPU kernel's prepared tensors, not the
checkpoint's, and rebuilding them in place is not implemented.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from pagedinfer.adapters.layers.linear import LinearBase
from pagedinfer.adapters.models.base import CausalLM
from pagedinfer.adapters.models.finite import WeightCheck, check_finite, checks_tensor
from pagedinfer.adapters.models.loader import (
    Header,
    TensorLoader,
    TensorTarget,
    bare_decoder_name,
    checkpoint_files,
    open_safetensors,
)
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.errors import CheckpointNotFoundError, NonFiniteWeightError, WeightUpdateError

__all__ = [
    "TensorMeta",
    "UpdatableRunner",
    "check_update",
    "check_update_from_path",
    "check_update_values",
    "safetensors_dtype",
    "tensor_meta",
    "write_update",
    "write_update_from_path",
]

ORIGIN = "update_weights"

_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class UpdatableRunner(Protocol):
    """What the functions here need of a rank's runner (``ModelRunner``)."""

    @property
    def model(self) -> CausalLM: ...

    @property
    def config(self) -> RunnerConfig: ...

    @property
    def weights_asleep(self) -> bool: ...


def _check_awake(runner: UpdatableRunner) -> None:
    if runner.weights_asleep:
        raise WeightUpdateError(
            "the weights are asleep (sleep() moved or dropped them): call "
            "wake_up(tags=['weights']) (or wake_up()) before updating them."
        )


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A tensor's checkpoint name, safetensors dtype name and full shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype`` (``F32``, ``BF16``, ...), or torch's for others."""
    return _SAFETENSORS_DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def tensor_meta(name: str, tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(name, safetensors_dtype(tensor.dtype), tuple(tensor.shape))


def _given(header: tuple[str, tuple[int, ...]]) -> Header:
    return lambda: header


def _loader(model: CausalLM, check: WeightCheck) -> TensorLoader:
    return TensorLoader(model, None, check, origin=ORIGIN, error=WeightUpdateError)


def _refuse_quantized(model: CausalLM, name: str) -> None:
    """Raise :class:`WeightUpdateError` if tensor ``name`` belongs to a quantized layer."""
    param_name, _ = model.weight_mapping.to_parameter(bare_decoder_name(name))
    module_name = param_name.rpartition(".")[0]
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return  # not a layer of this model: the loader's checks name the problem
    if isinstance(module, LinearBase) and module.quant is not None:
        quantization = model.config.quantization
        described = quantization.describe() if quantization is not None else "quantized"
        raise WeightUpdateError(
            f"{ORIGIN}: tensor {name!r} belongs to {module.quant.name}, a quantized layer "
            f"(quantization_config: {described}): update_weights writes the unquantized "
            "layers only (once loaded, a quantized layer holds its dequantized weight or its "
            "kernel's prepared tensors, not the checkpoint's). Leave its tensors out, or "
            "start a new Engine on the new checkpoint."
        )


def check_update(runner: UpdatableRunner, metas: Sequence[TensorMeta]) -> int:
    """Phase 1 for ``metas``: raise :class:`WeightUpdateError` on the first tensor that does
    not fit this rank's model; the number of tensors this rank will write."""
    _check_awake(runner)
    loader = _loader(runner.model, runner.config.weight_check)
    writes = 0
    for meta in metas:
        _refuse_quantized(runner.model, meta.name)
        target = loader.resolve(meta.name, None, _given((meta.dtype, meta.shape)))
        if target is not None:
            writes += 1
    return writes


def check_update_values(
    check: WeightCheck, weights: Iterable[tuple[str, torch.Tensor]], origin: str = ORIGIN
) -> None:
    """Phase 1's value check: no NaN or infinity in the tensors ``check`` names (by name:
    scales, norms and biases by default); :class:`WeightUpdateError` naming the first."""
    for name, tensor in weights:
        if checks_tensor(name, tensor, check):
            try:
                check_finite(name, tensor, origin)
            except NonFiniteWeightError as error:
                raise WeightUpdateError(str(error)) from error


def write_update(runner: UpdatableRunner, weights: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Phase 2 for one chunk of tensors phase 1 passed: copy each into its parameter in
    place (this rank's shard); the number written."""
    loader = _loader(runner.model, "none")  # the values were checked in phase 1
    written = 0
    with torch.no_grad():
        for name, tensor in weights:
            meta = tensor_meta(name, tensor)
            target = loader.resolve(name, None, _given((meta.dtype, meta.shape)))
            if target is None:
                continue
            if isinstance(target, TensorTarget):
                loader.write(target, name, None, tensor)
            else:
                loader.set_kv_scale(tensor, name, None, target)
            written += 1
    return written


def _checks(name: str, dtype: str, shape: tuple[int, ...], check: WeightCheck) -> bool:
    """:func:`~pagedinfer.adapters.models.finite.checks_tensor` from a tensor's header."""
    if check == "none" or not dtype.startswith(("F", "BF")):
        return False
    return check == "all" or len(shape) < 2 or not name.endswith(".weight")


def _files(path: str | Path) -> list[Path]:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"{str(root)!r} is not a directory: update_weights_from_path expects a checkpoint "
            "directory holding *.safetensors files."
        )
    return checkpoint_files(root)


def check_update_from_path(runner: UpdatableRunner, path: str | Path) -> int:
    """Phase 1 for the safetensors files of checkpoint directory ``path``, from their
    headers, and the values ``weight_check`` names (read once here, once to write)."""
    _check_awake(runner)
    model, check = runner.model, runner.config.weight_check
    loader = TensorLoader(model, Path(path), check, error=WeightUpdateError)
    writes = 0
    for file in _files(path):
        with open_safetensors(file) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                _refuse_quantized(model, name)
                header = loader.read_header(handle, name, file)
                target = loader.resolve(name, file, _given(header))
                if target is None:
                    continue
                if _checks(name, *header, check):
                    tensor = loader.read_tensor(handle, name, file)
                    check_update_values(check, [(name, tensor)], loader.where(file))
                writes += 1
    return writes


def write_update_from_path(runner: UpdatableRunner, path: str | Path) -> int:
    """Phase 2 for checkpoint directory ``path``: one tensor read at a time."""
    loader = TensorLoader(runner.model, Path(path), "none", error=WeightUpdateError)
    written = 0
    with torch.no_grad():
        for file in _files(path):
            with open_safetensors(file) as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    loader.load_tensor(handle, name, file)
                    written += 1
    return written
