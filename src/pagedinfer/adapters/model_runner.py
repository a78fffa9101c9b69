"""``ModelRunner``: one rank's model, KV cache and sampler; runs a ``BatchPlan`` per call.

Construction: read the checkpoint's config, build the model on the target device in the
target dtype, load the weights, size the KV cache (CUDA: after a warm-up pass, from the memory
budget; CPU: ``num_kv_blocks`` or a share of free RAM), allocate it and bind one view per
attention layer. :meth:`ModelRunner.execute` then turns each plan into tensors in one place
(:meth:`ModelRunner.prepare`), runs the model, computes logits only for the sampled rows and
samples on rank 0.
"""

from __future__ import annotations

import gc
from array import array
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedinfer.adapters.attention import create_backend
from pagedinfer.adapters.attention.base import AttentionMetadata
from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS, ParallelContext
from pagedinfer.adapters.kv_cache import (
    allocate_kv_cache,
    available_host_memory,
    cpu_kv_block_budget,
    cuda_kv_block_budget,
    kv_block_bytes,
    max_useful_blocks,
)
from pagedinfer.adapters.layers.linear import divide
from pagedinfer.adapters.models.loader import load_weights
from pagedinfer.adapters.models.registry import build_model, read_model_config
from pagedinfer.adapters.plan_arrays import plan_tensor
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.adapters.sampler import Sampler, SamplingBatch, SamplingTable
from pagedinfer.domain.plan import PADDING_SLOT, BatchPlan, NewRequest
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.errors import ConfigurationError, EngineClosedError

__all__ = ["DecodeGraphRunner", "ModelRunner", "StepInputs"]


@dataclass(frozen=True, slots=True)
class StepInputs:
    """A plan as device tensors: everything the model and the sampler read in one step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor | None  # [n] int64; None when every row is sampled in order
    sampling: SamplingBatch | None  # None on ranks that do not sample


class DecodeGraphRunner(Protocol):
    """Replays captured CUDA graphs for decode steps (implemented in ``adapters/cuda_graph``)."""

    def can_replay(self, plan: BatchPlan) -> bool:
        """True when a captured graph covers this decode step (batch size, table width)."""
        ...

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """Copy ``inputs`` into the graph's static tensors, replay, return ``[T, hidden]``."""
        ...

    def close(self) -> None: ...


class ModelRunner:
    """Executes batch plans on one device (one tensor-parallel rank).

    ``num_kv_blocks`` is the size of the KV pool this runner allocated; the scheduler's block
    pool must have exactly that many blocks. With tensor parallelism every rank runs
    :meth:`execute` on the same plan; rank 0 returns the sampled ids, the others ``[]``.
    """

    def __init__(self, config: RunnerConfig, parallel: ParallelContext = SINGLE_PROCESS) -> None:
        assert config.tensor_parallel_size == parallel.world_size, (config, parallel)
        self.config = config
        self.parallel = parallel
        self.device = config.device
        self.dtype = config.dtype
        self.model_config = model_config = read_model_config(config.model_path)
        model_config.check_max_model_len(config.max_model_len)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        self.backend = create_backend(config.attention_backend, config.block_size)
        self.model = build_model(
            model_config,
            parallel=parallel,
            backend=self.backend,
            device=self.device,
            dtype=self.dtype,
        )
        load_weights(self.model, config.model_path)
        self.num_kv_heads = divide(
            model_config.num_key_value_heads, parallel.world_size, "num_key_value_heads"
        )
        self.block_bytes = kv_block_bytes(
            num_layers=model_config.num_hidden_layers,
            block_size=config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=model_config.head_dim,
            dtype=self.dtype,
        )
        self.sampler = Sampler(self.device, config.seed)
        # Rank 0 samples: it keeps every request's sampling parameters by slot.
        self.sampling_table = SamplingTable() if parallel.is_driver else None
        self._closed = False
        # Decode steps go through graph_runner when it is set; the warm-up pass that sizes
        # the cache runs eagerly, and graphs are captured once the cache is bound.
        self.graph_runner: DecodeGraphRunner | None = None
        self.num_kv_blocks = self._size_kv_cache()
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        self._bind_kv_cache(self.kv_cache)
        self.graph_runner = self._create_graph_runner()

    # ------------------------------------------------------------------ steps
    def execute(self, plan: BatchPlan) -> list[int]:
        """Run one step; return one sampled token id per sampled row (rank 0; others: [])."""
        if self._closed:
            raise EngineClosedError("the model runner was used after close()")
        inputs = self.prepare(plan)
        with torch.inference_mode():
            hidden = self._run_model(plan, inputs)
            if plan.num_samples == 0:  # only partial prefill chunks this step
                return []
            if inputs.sample_indices is not None:
                hidden = hidden.index_select(0, inputs.sample_indices)
            logits = self.model.compute_logits(hidden)
            if logits is None or inputs.sampling is None:
                return []
            token_ids = self.sampler(logits, inputs.sampling)
        return [int(token) for token in token_ids.tolist()]

    def prepare(self, plan: BatchPlan) -> StepInputs:
        """The only place a plan becomes tensors (and its sampling deltas are applied)."""
        device = self.device
        every_row_sampled = plan.num_samples == plan.num_tokens  # decode: rows in order
        sampling = None
        if self.sampling_table is not None:
            self.sampling_table.update(plan)
            sampling = self.sampling_table.batch(plan, device)
        return StepInputs(
            input_ids=plan_tensor(plan.input_ids, torch.int64, device),
            positions=plan_tensor(plan.positions, torch.int64, device),
            meta=AttentionMetadata.from_plan(plan, device),
            sample_indices=None
            if every_row_sampled
            else plan_tensor(plan.sample_indices, torch.int64, device),
            sampling=sampling,
        )

    def _run_model(self, plan: BatchPlan, inputs: StepInputs) -> torch.Tensor:
        graphs = self.graph_runner
        if graphs is not None and not plan.is_prefill and graphs.can_replay(plan):
            return graphs.replay(inputs)
        hidden: torch.Tensor = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return hidden

    def close(self) -> None:
        """Free the KV cache and the model. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.graph_runner is not None:
            self.graph_runner.close()
            self.graph_runner = None
        self._unbind_kv_cache()
        del self.kv_cache
        del self.model
        if self.device.type == "cuda":
            # Parameters reference their modules through their weight loaders (a cycle), so
            # the weights are freed by the cycle collector, not by `del`; run it now so the
            # memory is back before the next engine sizes its cache.
            gc.collect()
            torch.cuda.empty_cache()

    # --------------------------------------------------------------- KV cache
    def _size_kv_cache(self) -> int:
        config = self.config
        if config.num_kv_blocks is not None:
            if config.num_kv_blocks < 1:
                raise ConfigurationError(
                    f"num_kv_blocks={config.num_kv_blocks} is invalid: expected an integer >= 1 "
                    "(or None to size the cache from memory)."
                )
            num_blocks = config.num_kv_blocks
        elif self.device.type == "cuda":
            num_blocks = self._cuda_block_budget()
        else:
            num_blocks = cpu_kv_block_budget(
                available=available_host_memory(),
                block_bytes=self.block_bytes,
                max_blocks=max_useful_blocks(
                    max_num_seqs=config.max_num_seqs,
                    max_model_len=config.max_model_len,
                    block_size=config.block_size,
                ),
            )
        # Every rank must hold the same pool; take the smallest budget.
        return self.parallel.min_over_ranks(num_blocks, self.device)

    def _cuda_block_budget(self) -> int:
        """Run the largest prefill a step can hold, then size the cache from what is left."""
        device = self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        self._bind_kv_cache(self._allocate_kv_cache(1))  # slots are -1: nothing is stored
        self.execute(self._warm_up_plan())
        self._unbind_kv_cache()
        if self.sampling_table is not None:  # forget the warm-up's request
            self.sampling_table = SamplingTable()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        stats = torch.cuda.memory_stats(device)
        return cuda_kv_block_budget(
            total=total,
            used=total - free,
            peak=stats["allocated_bytes.all.peak"],
            current=stats["allocated_bytes.all.current"],
            utilization=self.config.gpu_memory_utilization,
            block_bytes=self.block_bytes,
        )

    def _warm_up_plan(self) -> BatchPlan:
        """A prefill of ``max_num_batched_tokens`` tokens sampling ``max_num_seqs`` rows.

        Sequences are ``max_model_len`` long (the last one shorter); no K/V is stored
        (padding slots). It runs over a one-block cache: backends that read every key through
        the block table (triton) find block 0 in every column, so all reads stay in bounds.
        Sampling uses top-k and top-p so that the sampler's sort is part of the measured peak;
        every sampled row uses sampling slot 0.
        """
        config = self.config
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

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return allocate_kv_cache(
            num_layers=self.model_config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=self.config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def _bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        layers = self.model.attention_layers()
        assert len(layers) == kv_cache.shape[1], (len(layers), kv_cache.shape)
        for index, layer in enumerate(layers):
            layer.bind_cache(kv_cache[0, index], kv_cache[1, index])

    def _unbind_kv_cache(self) -> None:
        for layer in self.model.attention_layers():
            layer.unbind_cache()

    def _create_graph_runner(self) -> DecodeGraphRunner | None:
        if (
            self.device.type != "cuda"
            or self.config.enforce_eager
            or not self.backend.supports_cuda_graphs
        ):
            return None
        from pagedinfer.adapters.cuda_graph import capture_decode_graphs

        config = self.config
        return capture_decode_graphs(
            self.model,
            self.backend,
            # The scheduler never runs more sequences in a step than tokens fit in one.
            max_num_seqs=min(config.max_num_seqs, config.max_num_batched_tokens),
            max_model_len=config.max_model_len,
            block_size=config.block_size,
            device=self.device,
        )
