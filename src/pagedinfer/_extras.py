"""The optional parts of pagedinfer, the packages each needs, and the error when one is missing.

``pip install .`` (in the checkout) is the core: :mod:`pagedinfer.domain` (pure Python and xxhash).
The engine and the model path (``pagedinfer.engine``, ``pagedinfer.adapters``: ``Engine``,
``LLM``, the command line's ``generate``) need the ``engine`` extra. Checked when those
packages are imported, without importing anything (``find_spec``), so the error names the
extra instead of a bare ``No module named 'torch'``.
"""

from __future__ import annotations

import importlib.util

from pagedinfer.errors import MissingDependencyError, install_hint

__all__ = ["ENGINE_EXTRA", "ENGINE_PACKAGES", "require_engine_extra"]

ENGINE_EXTRA = "engine"
# What pyproject.toml's [engine] extra installs, by import name.
ENGINE_PACKAGES = ("torch", "safetensors", "transformers")


def require_engine_extra(part: str) -> None:
    """Raise :class:`MissingDependencyError` naming the extra if ``part`` cannot work."""
    missing = [name for name in ENGINE_PACKAGES if not _installed(name)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise MissingDependencyError(
            f"{part} needs {', '.join(missing)}, which {verb} not installed: the core "
            "install (pip install .) has only the pure-Python scheduler "
            f"(pagedinfer.domain). Install the engine: {install_hint(ENGINE_EXTRA)}."
        )


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # blocked (sys.modules[name] = None) or broken
        return False
