"""FP8 KV cache: each attention layer's K and V scales, settled before the cache is sized.

A layer's scale is the checkpoint's where it gave one (``PagedAttention.set_kv_scales``),
else calibrated: the model prefills a fixed pseudo-random prompt (:func:`calibration_plan`,
the same tokens on every run and rank) into a cache in its own dtype, and the largest
``|K|`` / ``|V|`` it stored (:func:`cache_amax`, the maximum over tensor-parallel ranks) give
the scale (:func:`~pagedinfer.adapters.kv_cache.calibrated_scale`). :func:`fp8_kv_scales`
returns the rows ``[num_layers, 4]`` (``[k_scale, v_scale, 1/k_scale, 1/v_scale]``) and where
each came from. The runner owns running the pass (it binds the cache and runs its model).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.kv_cache import calibrated_scale, kv_cache_dtype_name, scale_row
from pagedinfer.adapters.layers.attention import PagedAttention
from pagedinfer.domain.plan import BatchPlan

__all__ = ["cache_amax", "calibration_plan", "fp8_kv_scales"]

_logger = logging.getLogger(__name__)


def fp8_kv_scales(
    layers: Sequence[PagedAttention],
    *,
    kv_cache_dtype: torch.dtype,
    device: torch.device,
    calibrate: Callable[[], list[list[float]]],
    log: bool = True,
) -> tuple[torch.Tensor, tuple[str, ...]]:
    """Each layer's scale row (the checkpoint's scales where it gave them, calibrated ones for
    the rest) and its source: ``"checkpoint"``, ``"calibrated"``, or ``"k/v"`` when K and V
    differ. ``calibrate`` runs the calibration pass (``[2][num_layers]`` amax values); it is
    called only when some scale is missing. ``log``: report the sources (the driver rank)."""
    given = [(layer.checkpoint_k_scale, layer.checkpoint_v_scale) for layer in layers]
    amax: list[list[float]] | None = None
    if any(k is None or v is None for k, v in given):
        amax = calibrate()
    rows: list[list[float]] = []
    sources: list[str] = []
    for index, (k_given, v_given) in enumerate(given):
        chosen: list[float] = []
        kinds: list[str] = []
        for which, value in enumerate((k_given, v_given)):
            if value is None:
                assert amax is not None
                value = calibrated_scale(amax[which][index], kv_cache_dtype)
                kinds.append("calibrated")
            else:
                kinds.append("checkpoint")
            chosen.append(value)
        rows.append(scale_row(*chosen))
        sources.append(kinds[0] if kinds[0] == kinds[1] else "/".join(kinds))
    if log:
        _logger.info(
            "FP8 KV cache (%s): per-layer scales %s",
            kv_cache_dtype_name(kv_cache_dtype),
            ", ".join(f"{source} x{sources.count(source)}" for source in sorted(set(sources))),
        )
    scales = torch.tensor(rows, dtype=torch.float32, device=device)
    return scales, tuple(sources)


def cache_amax(cache: torch.Tensor, parallel: ParallelContext) -> list[list[float]]:
    """Largest ``|K|`` and ``|V|`` per layer of a ``[2, num_layers, ...]`` cache,
    ``[2][num_layers]``: the maximum over ranks (each rank saw its own heads)."""
    amax = cache.abs().amax(dim=(2, 3, 4, 5)).to(torch.float32)
    if parallel.world_size > 1:
        negated = -amax
        group = parallel.group
        if group is not None:
            group.all_reduce(negated, minimum=True)
        else:
            dist.all_reduce(negated, op=dist.ReduceOp.MIN)
        amax = -negated
    values: list[list[float]] = amax.cpu().tolist()
    return values


def calibration_plan(length: int, *, block_size: int, vocab_size: int) -> BatchPlan:
    """One sequence of ``length`` pseudo-random tokens (the same ones on every run and
    rank), stored in blocks ``0..cdiv(length, block_size)-1``; nothing is sampled."""
    num_blocks = -(-length // block_size)
    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randint(vocab_size, (length,), generator=generator)
    return BatchPlan(
        is_prefill=True,
        block_size=block_size,
        seq_ids=array("q", [0]),
        query_lens=array("i", [length]),
        context_lens=array("i", [length]),
        cu_seqlens_q=array("i", [0, length]),
        cu_seqlens_k=array("i", [0, length]),
        max_seqlen_q=length,
        max_seqlen_k=length,
        block_tables=array("i", range(num_blocks)),
        block_table_width=num_blocks,
        input_ids=array("q", token_ids.tolist()),
        positions=array("q", range(length)),
        slot_mapping=array("q", range(length)),
        sample_indices=array("q"),
        sample_slots=array("i"),
    )
