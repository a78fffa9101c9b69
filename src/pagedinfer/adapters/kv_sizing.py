"""How many KV blocks a runner allocates, and the warm-up pass that measures it on CUDA.

In order of precedence: the configured ``num_kv_blocks``; ``kv_cache_memory_bytes`` divided
by the bytes of one block; on CUDA, what ``gpu_memory_utilization`` leaves after the peak of
a warm-up pass (:func:`warm_up_plan`: the largest prefill a step can hold, sampling as many
rows as a step can, run by the runner over a one-block cache); on the CPU, a share of the free
RAM, at most what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use. The
arithmetic lives in :mod:`pagedinfer.adapters.kv_cache`; every rank then takes the minimum
over ranks (the runner's part).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

import torch

from pagedinfer.adapters.kv_cache import (
    available_host_memory,
    blocks_for_memory,
    cpu_kv_block_budget,
    cuda_kv_block_budget,
    max_useful_blocks,
)
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.domain.kv_groups import KVGroupSpec, min_blocks_for_one_sequence
from pagedinfer.domain.plan import PADDING_SLOT, BatchPlan, NewRequest
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.errors import ConfigurationError

__all__ = ["cuda_block_budget", "kv_cache_blocks", "warm_up_plan"]


def kv_cache_blocks(
    config: RunnerConfig,
    *,
    block_bytes: int,
    model: torch.nn.Module,
    cuda_budget: Callable[[], int],
    kv_groups: tuple[KVGroupSpec, ...] = (),
) -> int:
    """This rank's number of KV blocks (see the module docstring). ``block_bytes``: one
    block of every cache the runner holds; ``model``: its weights count against the CPU's
    RAM; ``cuda_budget``: measures the CUDA budget (the runner's warm-up, see
    :func:`cuda_block_budget`). Raises :class:`ConfigurationError` for ``num_kv_blocks < 1``."""
    if config.num_kv_blocks is not None:
        if config.num_kv_blocks < 1:
            raise ConfigurationError(
                f"num_kv_blocks={config.num_kv_blocks} is invalid: expected an integer >= 1 "
                "(or None to size the cache from memory)."
            )
        return config.num_kv_blocks
    if config.kv_cache_memory_bytes is not None:
        return blocks_for_memory(config.kv_cache_memory_bytes, block_bytes)
    if config.device.type == "cuda":
        return cuda_budget()
    # With KV groups (hybrid attention) a sequence holds a table per group, and the null block.
    num_groups = max(len(kv_groups), 1)
    return cpu_kv_block_budget(
        available=available_host_memory(),
        block_bytes=block_bytes,
        max_blocks=max_useful_blocks(
            max_num_seqs=config.max_running,
            max_model_len=config.max_model_len,
            block_size=config.block_size,
        )
        * num_groups
        + (num_groups > 1),
        min_blocks=min_blocks_for_one_sequence(
            kv_groups, config.block_size, config.max_model_len, config.max_num_batched_tokens
        ),
        weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
    )


def cuda_block_budget(
    device: torch.device, *, utilization: float, block_bytes: int, warm_up: Callable[[], None]
) -> int:
    """Run ``warm_up`` (the largest step, over a one-block cache), then the blocks that fit
    in what ``utilization`` of the device's memory leaves beside its peak."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    warm_up()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    return cuda_kv_block_budget(
        total=total,
        used=total - free,
        peak=stats["allocated_bytes.all.peak"],
        current=stats["allocated_bytes.all.current"],
        utilization=utilization,
        block_bytes=block_bytes,
    )


def warm_up_plan(config: RunnerConfig) -> BatchPlan:
    """A prefill of ``max_num_batched_tokens`` tokens sampling ``max_num_seqs`` rows.

    Sequences are ``max_model_len`` long (the last one shorter); no K/V is stored
    (padding slots). It runs over a one-block cache: backends that read every key through
    the block table (triton) find block 0 in every column, so all reads stay in bounds.
    Sampling uses top-k and top-p so that the sampler's sort is part of the measured peak;
    every sampled row uses sampling slot 0.
    """
    budget = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
    lengths: list[int] = []
    while budget > 0:
        lengths.append(min(config.max_model_len, budget))
        budget -= lengths[-1]
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    num_tokens = cu[-1]
    num_samples = min(num_tokens, config.max_num_seqs)
    width = -(-max(lengths) // config.block_size)
    return BatchPlan(
        is_prefill=True,
        block_size=config.block_size,
        seq_ids=array("q", range(len(lengths))),
        query_lens=array("i", lengths),
        context_lens=array("i", lengths),
        cu_seqlens_q=array("i", cu),
        cu_seqlens_k=array("i", cu),
        max_seqlen_q=max(lengths),
        max_seqlen_k=max(lengths),
        block_tables=array("i", [0]) * (width * len(lengths)),
        block_table_width=width,
        input_ids=array("q", [0]) * num_tokens,
        positions=array("q", [p for length in lengths for p in range(length)]),
        slot_mapping=array("q", [PADDING_SLOT]) * num_tokens,
        sample_indices=array("q", range(num_samples)),
        sample_slots=array("i", [0]) * num_samples,
        new_requests=(NewRequest(0, 0, SamplingParams(top_k=50, top_p=0.9), 0),),
    )
