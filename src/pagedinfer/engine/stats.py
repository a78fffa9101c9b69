"""The engine's counters: :class:`EngineStats` (what ``Engine.stats()`` returns) and
:class:`StepAccounting` (the token and time counts each recorded step adds to)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedinfer.adapters.kv_cache import kv_block_bytes
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.scheduler.group_allocator import KVGroupUsage

if TYPE_CHECKING:
    import torch

    from pagedinfer.adapters.models.config import ModelConfig
    from pagedinfer.domain.scheduler import Scheduler

__all__ = ["EngineStats", "HostTierStats", "StepAccounting", "host_tier_stats"]


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """The host KV tier (``kv_offloading_size``): its size and use now, counters since the
    start. A block copied in is a prefix hit that was not recomputed."""

    num_blocks: int  # slots
    block_bytes: int
    bytes_used: int  # resident and in-flight blocks
    hit_tokens: int  # prompt tokens found in the tier after a device miss (then copied in)
    lookup_tokens: int  # prompt tokens looked up there
    blocks_copied_out: int
    blocks_copied_in: int
    evictions: int  # resident blocks dropped to make room (LRU)
    load_wait_steps: int  # steps requests spent waiting for their copies in (summed)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters since the engine started. Throughputs are tokens per second of step time."""

    num_requests_finished: int
    num_waiting: int
    num_running: int
    num_prompt_tokens: (
        int  # prompt tokens computed (cache hits and recomputation excluded/included as run)
    )
    num_generated_tokens: int
    prefill_throughput: float
    decode_throughput: float
    prefix_cache_hit_rate: float  # fraction of looked-up prompt tokens served from the cache
    kv_cache_usage: float  # fraction of KV blocks in use now (a hybrid model's null block: not)
    num_kv_blocks: int
    num_preemptions: int
    # Speculative decoding (vLLM's spec_decode counters): verify rows with drafts, drafts
    # verified, drafts accepted, and drafts accepted at each position of a row.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # Hybrid attention: each KV group's window, layers, blocks held now and the most one
    # sequence holds (sliding groups); empty with one group (every model without a window).
    kv_groups: tuple[KVGroupUsage, ...] = ()
    host_tier: HostTierStats | None = None  # kv_offloading_size; None without a tier

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted drafts / drafts verified (0.0 before any)."""
        drafts = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafts if drafts else 0.0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens per verify row: 1 + accepted drafts per row (0.0 before any)."""
        rows = self.spec_decode_num_drafts
        return 1.0 + self.spec_decode_num_accepted_tokens / rows if rows else 0.0


class StepAccounting:
    """Prompt and generated tokens, and the step time spent on each, over recorded steps."""

    __slots__ = (
        "decode_seconds",
        "generated_tokens",
        "last_step",
        "prefill_seconds",
        "prompt_tokens",
    )

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.last_step = (False, 0, 0.0)  # (is_prefill, tokens, seconds) of the latest step

    def add(self, plan: BatchPlan, num_sampled: int, seconds: float) -> None:
        """Count a recorded step of ``plan`` that sampled ``num_sampled`` tokens in
        ``seconds``. A mixed step's time is shared between prefill and decode by their token
        counts (speculative decoding's verify rows are chunks, but decoding work)."""
        prompt_tokens = plan.num_tokens - plan.num_decode_rows - plan.num_generation_tokens
        prefill_seconds = seconds * prompt_tokens / plan.num_tokens if plan.num_tokens else 0.0
        self.prompt_tokens += prompt_tokens
        self.prefill_seconds += prefill_seconds
        self.decode_seconds += seconds - prefill_seconds
        self.generated_tokens += num_sampled
        self.last_step = (prompt_tokens > 0, prompt_tokens or plan.num_tokens, seconds)

    def discount(self, num_samples: int) -> None:
        """``num_samples`` counted by :meth:`add` were not generated tokens (the samples after
        a rejected draft)."""
        self.generated_tokens -= num_samples

    @property
    def prefill_throughput(self) -> float:
        return _rate(self.prompt_tokens, self.prefill_seconds)

    @property
    def decode_throughput(self) -> float:
        return _rate(self.generated_tokens, self.decode_seconds)


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def host_tier_stats(
    scheduler: Scheduler, model: ModelConfig, dtype: torch.dtype
) -> HostTierStats | None:
    """:class:`HostTierStats` of the ``scheduler``'s host KV tier (``None`` without one), for
    a ``model`` whose KV cache holds ``dtype`` (one rank: the tier runs with one only)."""
    tier = scheduler.host_tier
    if tier is None:
        return None
    stats = tier.stats()
    size = tier.block_size
    block_bytes = kv_block_bytes(
        num_layers=model.num_hidden_layers,
        block_size=size,
        num_kv_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        dtype=dtype,
    )
    return HostTierStats(
        num_blocks=stats.num_slots,
        block_bytes=block_bytes,
        bytes_used=stats.num_used_slots * block_bytes,
        hit_tokens=stats.hit_blocks * size,
        lookup_tokens=stats.lookup_blocks * size,
        blocks_copied_out=stats.blocks_copied_out,
        blocks_copied_in=stats.blocks_copied_in,
        evictions=stats.evictions,
        load_wait_steps=stats.load_wait_steps,
    )
