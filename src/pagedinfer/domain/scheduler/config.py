"""The scheduler's settings (:class:`SchedulerConfig`) and counters (:class:`SchedulerStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from pagedinfer.domain.kv_groups import KVGroupSpec, is_plain, min_blocks_for_one_sequence
from pagedinfer.errors import ConfigurationError

__all__ = ["SCHEDULING_POLICIES", "SchedulerConfig", "SchedulerStats", "SchedulingPolicy"]

# "mixed": decode rows and prefill chunks share each step's budget (decode first);
# "prefill_first": prefill steps before decode steps (a decode waits for every prefill).
SchedulingPolicy = Literal["mixed", "prefill_first"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = get_args(SchedulingPolicy)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 256
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    scheduling_policy: SchedulingPolicy = "mixed"
    # Speculative decoding: drafts verified per step (k; 0: off), and the positions past a
    # verify row's drafts whose blocks are given with it when free (a draft model stores the
    # K/V of its next drafts there).
    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0
    # Hybrid attention: the model's KV groups (pagedinfer.domain.kv_groups). Empty, or one
    # full-attention group: one block table per sequence.
    kv_groups: tuple[KVGroupSpec, ...] = ()
    # LoRA: the distinct adapters one step may hold (the executor's device slots; 0: none).
    max_loras: int = 0
    # Host KV tier (pagedinfer.domain.host_tier): its slots (blocks); 0: no tier.
    num_host_blocks: int = 0

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigurationError(
                f"scheduling_policy={self.scheduling_policy!r} is unknown: expected one of "
                f"{', '.join(repr(name) for name in SCHEDULING_POLICIES)} ('mixed' runs "
                "prefill chunks alongside decode rows; 'prefill_first' runs them first)."
            )
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"{name}={value!r} is invalid: expected an integer >= 1.")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ConfigurationError(
                f"max_model_len={self.max_model_len!r} is invalid: expected an integer >= 2 "
                "(one prompt token plus one generated token)."
            )
        for name in (
            "num_speculative_tokens",
            "num_lookahead_tokens",
            "max_loras",
            "num_host_blocks",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigurationError(f"{name}={value!r} is invalid: expected an integer >= 0.")
        if not self.is_plain:
            self._check_grouped_capacity()
            return
        capacity = self.num_blocks * self.block_size
        if capacity < self.max_model_len:
            raise ConfigurationError(
                f"the KV pool holds {capacity} tokens ({self.num_blocks} blocks x "
                f"{self.block_size}) but max_model_len is {self.max_model_len}: the pool must "
                "hold at least one max_model_len sequence. Give it more blocks (more memory, "
                "num_kv_blocks) or lower max_model_len."
            )

    @property
    def is_plain(self) -> bool:
        """One block table per sequence (no KV groups, or one full-attention group)."""
        return is_plain(self.kv_groups)

    @property
    def num_kv_groups(self) -> int:
        return max(len(self.kv_groups), 1)

    def _check_grouped_capacity(self) -> None:
        needed = min_blocks_for_one_sequence(
            self.kv_groups, self.block_size, self.max_model_len, self.max_num_batched_tokens
        )
        if self.num_blocks < needed:
            raise ConfigurationError(
                f"the KV pool has {self.num_blocks} blocks but one max_model_len="
                f"{self.max_model_len} sequence needs {needed} across its "
                f"{len(self.kv_groups)} KV groups (windows "
                f"{[group.window for group in self.kv_groups]}, block_size "
                f"{self.block_size}, plus the null block). Give it more blocks (more memory, "
                "num_kv_blocks) or lower max_model_len / max_num_batched_tokens."
            )

    @property
    def max_running(self) -> int:
        # Every running sequence must fit in one decode step, or some would starve.
        return min(self.max_num_seqs, self.max_num_batched_tokens)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Queue sizes now, and counts since the start. Steps are counted by what they hold:
    prefill chunks only, decode rows only, or both (mixed)."""

    num_waiting: int
    num_running: int
    num_preemptions: int
    num_prefill_steps: int
    num_decode_steps: int
    num_mixed_steps: int = 0
    # Speculative decoding: verify rows with drafts, drafts verified, drafts accepted, and
    # drafts accepted by position in the row (vLLM's spec_decode counters).
    num_spec_verify_rows: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
