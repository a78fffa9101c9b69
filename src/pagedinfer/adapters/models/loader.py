"""Fill a model's parameters from the ``*.safetensors`` files of a checkpoint directory.

Each checkpoint tensor is routed to the parameter it belongs to (through the model's
``packed_modules_mapping`` for packed projections) and handed to that parameter's
``weight_loader``, which copies this rank's shard into place. Tensors are memory-mapped on the
host and only the shard is copied, converted to the parameter's dtype on its device.
Every parameter must be covered, and every tensor must be used, or loading fails with the name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from safetensors import safe_open

from pagedinfer.adapters.layers.linear import ShardId, get_weight_loader
from pagedinfer.adapters.models.base import CausalLM
from pagedinfer.errors import UnsupportedModelError

__all__ = ["load_weights"]

_MAX_NAMES_SHOWN = 5


def load_weights(model: CausalLM, path: str | Path) -> None:
    """Load every ``*.safetensors`` file in ``path`` into ``model``.

    Raises :class:`UnsupportedModelError` naming the checkpoint and the weight if there are no
    safetensors files, a tensor has no parameter, a parameter has no tensor, or a shape is off.
    """
    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(
            f"checkpoint {str(root)!r} has no *.safetensors files: expected the model weights "
            "in safetensors format (convert .bin / .pt checkpoints with transformers' "
            "save_pretrained)."
        )
    params = dict(model.named_parameters())
    expected = {
        name
        for param_name in params
        for name in _checkpoint_names(param_name, model.packed_modules_mapping)
    }
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if model.is_ignored_weight(name):
                    continue
                param_name, shard_id = _route(name, model.packed_modules_mapping)
                param = params.get(param_name)
                if param is None:
                    raise UnsupportedModelError(
                        f"checkpoint {str(root)!r}: weight {name!r} (in {file.name}) matches no "
                        f"parameter of {type(model).__name__}; the checkpoint does not fit the "
                        "architecture its config.json names."
                    )
                try:
                    get_weight_loader(param)(param, handle.get_tensor(name), shard_id)
                except ValueError as error:
                    raise UnsupportedModelError(
                        f"checkpoint {str(root)!r}: weight {name!r}: {error}"
                    ) from error
                loaded.add(name)
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(repr(name) for name in missing[:_MAX_NAMES_SHOWN])
        more = (
            f" and {len(missing) - _MAX_NAMES_SHOWN} more"
            if len(missing) > _MAX_NAMES_SHOWN
            else ""
        )
        raise UnsupportedModelError(
            f"checkpoint {str(root)!r} is missing weights {shown}{more}: expected a complete "
            f"{model.config.architecture} checkpoint."
        )


def _route(name: str, mapping: Mapping[str, tuple[str, ShardId]]) -> tuple[str, ShardId]:
    """Checkpoint tensor name -> (parameter name, shard id)."""
    for checkpoint_module, (packed_module, shard_id) in mapping.items():
        part = f".{checkpoint_module}."
        if part in name:
            return name.replace(part, f".{packed_module}.", 1), shard_id
    return name, None


def _checkpoint_names(param_name: str, mapping: Mapping[str, tuple[str, ShardId]]) -> list[str]:
    """Parameter name -> the checkpoint tensors that must fill it."""
    names = [
        param_name.replace(f".{packed}.", f".{checkpoint_module}.", 1)
        for checkpoint_module, (packed, _) in mapping.items()
        if f".{packed}." in param_name
    ]
    return names or [param_name]
