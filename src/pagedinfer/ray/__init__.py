"""Data-parallel offline inference on Ray Data: one Engine per replica (``pip install
'.[ray]'`` in the checkout).

``EnginePredictor`` is a callable class for ``ray.data.Dataset.map_batches``;
``generate(prompts, model, params, num_replicas=N)`` covers the common case. See
docs/scaling.md.

Importing this package loads neither Ray nor torch: its names are loaded on first access.
``EnginePredictor`` itself does not need Ray (the engine is built in the actor);
``generate`` does, and raises ``MissingDependencyError`` (an ``ImportError``) naming the extra
to install when Ray is missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedinfer.ray.data_parallel import Generation, generate
    from pagedinfer.ray.predictor import EnginePredictor

__all__ = ["EnginePredictor", "Generation", "generate"]

_LAZY = {
    "EnginePredictor": "pagedinfer.ray.predictor",
    "Generation": "pagedinfer.ray.data_parallel",
    "generate": "pagedinfer.ray.data_parallel",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'pagedinfer.ray' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
