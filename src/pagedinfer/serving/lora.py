"""LoRA adapters served under their own model names (vLLM's ``--lora-modules``).

A request selects an adapter by its ``model`` field: the base model's served name runs the
base model, an adapter's name runs that adapter. :class:`ServedLoRAs` maps names to
:class:`~pagedinfer.domain.lora.LoRARequest` s, each with a fresh id (ids are never reused, so
an adapter loaded again under the same name never finds the old one's tensors or prefix
cache). ``--lora-modules`` takes ``name=path`` or vLLM's JSON form
``{"name": ..., "path": ..., "base_model_name": ...}``. Pure Python: the command line reads it
without the serve extra.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading

from pagedinfer.domain.lora import LoRARequest

__all__ = [
    "RUNTIME_LORA_ENV",
    "ServedLoRAs",
    "add_lora_arguments",
    "parse_lora_module",
    "runtime_lora_updating",
]

# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter (also --flag here).
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def parse_lora_module(text: str) -> tuple[str, str]:
    """``name=path`` or ``{"name": ..., "path": ...}`` as ``(name, path)``; ``ValueError``
    saying what is expected."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as error:
            raise ValueError(f"invalid JSON in --lora-modules {text!r}: {error}") from None
        name, path = value.get("name"), value.get("path") if isinstance(value, dict) else None
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(
                f"--lora-modules {text!r}: the JSON form needs a non-empty 'name' and 'path'."
            )
        return name, path
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(
            f"--lora-modules {text!r}: expected name=path (or vLLM's JSON form "
            '\'{"name": "sql", "path": "/adapters/sql"}\').'
        )
    return name, path


def runtime_lora_updating(flag: bool, environ: dict[str, str]) -> bool:
    """Whether the load/unload routes are served: the flag, or vLLM's variable set to true."""
    return flag or environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """``pagedinfer serve``'s LoRA flags (``--enable-lora`` and the sizes are engine options)."""
    group = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="adapters served under their own model names: name=path or vLLM's JSON form "
        '{"name": ..., "path": ...} (needs --enable-lora)',
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API "
        f"key; also ${RUNTIME_LORA_ENV}=true, as vLLM)",
    )


class ServedLoRAs:
    """The adapters a server serves, by model name."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def get(self, name: str | None) -> LoRARequest | None:
        """The adapter served as ``name`` (None: the base model or unknown)."""
        return None if name is None else self._by_name.get(name)

    def new(self, name: str, path: str) -> LoRARequest:
        """A request for adapter ``name`` at ``path`` with an id never used before (not
        served until :meth:`publish`)."""
        with self._lock:
            return LoRARequest(name, next(self._ids), path)

    def publish(self, lora: LoRARequest) -> None:
        with self._lock:
            self._by_name[lora.lora_name] = lora

    def withdraw(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.pop(name, None)

    def all(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())
