"""Settings that do not fit the CPU (vLLM command lines and ``LLM`` calls written for a GPU):
each is named with the reason, as a warning, when the engine runs on the CPU."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from pagedinfer.engine.config import EngineConfig, resolve_device

__all__ = ["cpu_notes", "explicit_options", "flag_spelling", "keyword_spelling"]


def explicit_options(options: dict[str, object]) -> frozenset[str]:
    """The options of ``options`` set to something else than their default."""
    defaults = EngineConfig.__dataclass_fields__
    return frozenset(
        name
        for name, value in options.items()
        if name in defaults and value != defaults[name].default
    )


def flag_spelling(name: str, value: object) -> str:
    """An option as the command line spells it: ``--tensor-parallel-size 2``."""
    return f"--{name.replace('_', '-')} {value}"


def keyword_spelling(name: str, value: object) -> str:
    """An option as Python spells it: ``tensor_parallel_size=2``."""
    return f"{name}={value!r}"


def cpu_notes(
    config: EngineConfig,
    explicit: frozenset[str],
    spell: Callable[[str, object], str] = flag_spelling,
) -> list[str]:
    """Warnings for settings that do not fit the CPU when the engine runs there (``explicit``:
    the options the user set, which a default never warns about; ``spell`` names one)."""
    if resolve_device(config.device).type != "cpu":
        return []
    notes = []
    cpus = os.cpu_count() or 1
    tp = config.tensor_parallel_size
    if tp > 1:
        notes.append(
            f"{spell('tensor_parallel_size', tp)} on the CPU runs {tp} worker processes that "
            f"share this machine's {cpus} CPUs and exchange every layer's activations: it is "
            "for testing, not speed (one rank is faster on one machine; "
            "docs/tensor-parallelism.md)"
        )
    if "dtype" in explicit and config.dtype in ("float16", "fp16", "half", torch.float16):
        notes.append(
            f"{spell('dtype', config.dtype)} on the CPU: torch's CPU kernels compute float16 "
            "slowly and with less range than the CPU default, float32 (dtype auto); "
            "bfloat16 is the 16-bit choice where the CPU has it"
        )
    if "gpu_memory_utilization" in explicit:
        notes.append(
            f"{spell('gpu_memory_utilization', config.gpu_memory_utilization)} sizes nothing "
            "on the CPU: the KV cache is sized by kv_cache_memory_bytes or num_kv_blocks "
            "(default: sized from the configuration and memory)"
        )
    return notes
