"""The host KV tier's options (vLLM's names): ``kv_offloading_size`` in GiB and
``kv_offloading_backend`` ("native", the only one). The mechanism: docs/kv_tiers.md,
:mod:`pagedinfer.domain.host_tier` (the index) and :mod:`pagedinfer.adapters.host_kv_tier`
(the memory and its copies)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pagedinfer.errors import ConfigurationError

if TYPE_CHECKING:
    from pagedinfer.engine.config import EngineConfig

__all__ = [
    "KV_OFFLOADING_BACKENDS",
    "check_kv_offloading",
    "kv_offloading_bytes",
]

KV_OFFLOADING_BACKENDS = ("native",)
GIB = 1 << 30


def check_kv_offloading(config: EngineConfig) -> None:
    """Raise :class:`ConfigurationError` for a tier the engine cannot run."""
    size = config.kv_offloading_size
    backend = config.kv_offloading_backend
    if backend is not None and backend not in KV_OFFLOADING_BACKENDS:
        raise ConfigurationError(
            f"kv_offloading_backend={backend!r} is not supported: pagedinfer's own host tier "
            "is 'native' (the only choice; leave it unset, or pass 'native')."
        )
    if size is None:
        if backend is not None:
            raise ConfigurationError(
                f"kv_offloading_backend={backend!r} needs kv_offloading_size (GiB of host "
                "memory for the tier), as in vLLM: pass both, or neither."
            )
        return
    if (
        not isinstance(size, (int, float))
        or isinstance(size, bool)
        or not math.isfinite(size)
        or size <= 0
    ):
        raise ConfigurationError(
            f"kv_offloading_size={size!r} is invalid: expected GiB of host memory > 0 "
            "(e.g. 4 or 0.5), or None for no host tier."
        )
    if not config.enable_prefix_caching:
        raise ConfigurationError(
            "kv_offloading_size needs enable_prefix_caching=True: the host tier keeps blocks "
            "evicted from the prefix cache, indexed by the same hashes."
        )
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        raise ConfigurationError(
            "kv_offloading_size runs with one rank only (tensor_parallel_size=1, "
            "pipeline_parallel_size=1; not implemented for more): drop one of the two."
        )
    speculation = config.speculation
    if speculation is not None and speculation.method == "draft_model":
        raise ConfigurationError(
            "kv_offloading_size cannot run with a draft model (its own KV cache is not "
            "offloaded; not implemented): use speculative method 'ngram', or drop one."
        )


def kv_offloading_bytes(config: EngineConfig) -> int:
    """The tier's bytes of host memory (0: no tier)."""
    size = config.kv_offloading_size
    return 0 if size is None else int(size * GIB)
