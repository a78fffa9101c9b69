"""What an engine says about itself: the start-up line (:meth:`EngineReports.describe`) and
the counters (:meth:`EngineReports.stats`), a mixin of :class:`~pagedinfer.engine.engine.Engine`."""

from __future__ import annotations

import torch

from pagedinfer.adapters.kv_cache import kv_cache_dtype_name
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.domain.scheduler import Scheduler
from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.engine_lock import EngineLock
from pagedinfer.engine.output_processor import OutputProcessor
from pagedinfer.engine.request_table import RequestTable
from pagedinfer.engine.stats import EngineStats, host_tier_stats
from pagedinfer.errors import EngineClosedError

__all__ = ["EngineReports"]


class EngineReports:
    """``describe()`` and ``stats()`` of :class:`~pagedinfer.engine.engine.Engine`."""

    config: EngineConfig
    model_config: ModelConfig
    scheduler: Scheduler
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    attention_backend: str
    max_model_len: int
    _guard: EngineLock
    _closed: bool
    _table: RequestTable
    _outputs: OutputProcessor

    def _catch_up(self) -> None:
        raise NotImplementedError  # the engine's: records the steps still in flight

    def describe(self) -> str:
        """One line for a start-up log: the model and how it runs (device, dtype, attention
        backend, KV cache and its dtype when FP8, ``max_model_len``). Takes no lock (everything
        in it is fixed)."""
        scheduler = self.scheduler.config
        tp = self.config.tensor_parallel_size
        kv_dtype = ""
        if self.kv_cache_dtype != self.dtype:
            kv_dtype = f" ({kv_cache_dtype_name(self.kv_cache_dtype)})"
        return (
            f"model {self.config.model_path} ({self.model_config.architecture}): device "
            f"{self.device}, dtype {str(self.dtype).removeprefix('torch.')}, attention "
            f"{self.attention_backend}, {scheduler.num_blocks} KV blocks of "
            f"{scheduler.block_size} tokens{kv_dtype}, max_model_len {self.max_model_len}"
            + (f", tensor_parallel_size {tp}" if tp > 1 else "")
            + (f", quantization {q.describe()}" if (q := self.model_config.quantization) else "")
        )

    def stats(self) -> EngineStats:
        """The counters; also on a dead engine (what it did before it died)."""
        with self._guard.held():
            if self._closed:
                raise EngineClosedError("the engine is closed; create a new Engine.")
            self._catch_up()
            pool = self.scheduler.pool.stats()
            scheduler = self.scheduler.stats()
            counts = self._outputs.accounting
            kv_groups = self.scheduler.kv_group_usage()
            # A grouped allocator (hybrid attention) holds the null block for life: not usage.
            reserved = 1 if kv_groups else 0
            usable = pool.num_blocks - reserved
            return EngineStats(
                num_requests_finished=self._table.num_finished,
                num_waiting=scheduler.num_waiting,
                num_running=scheduler.num_running,
                num_prompt_tokens=counts.prompt_tokens,
                num_generated_tokens=counts.generated_tokens,
                prefill_throughput=counts.prefill_throughput,
                decode_throughput=counts.decode_throughput,
                prefix_cache_hit_rate=pool.prefix_hit_rate,
                kv_cache_usage=(pool.num_used_blocks - reserved) / usable if usable else 0.0,
                num_kv_blocks=pool.num_blocks,
                num_preemptions=scheduler.num_preemptions,
                spec_decode_num_drafts=scheduler.num_spec_verify_rows,
                spec_decode_num_draft_tokens=scheduler.num_draft_tokens,
                spec_decode_num_accepted_tokens=scheduler.num_accepted_tokens,
                spec_decode_num_accepted_tokens_per_pos=scheduler.accepted_per_position,
                kv_groups=kv_groups,
                host_tier=host_tier_stats(self.scheduler, self.model_config, self.kv_cache_dtype),
            )
