"""``ModelRunner``: one rank's model, KV cache and sampler; runs a ``BatchPlan`` per call.

Construction: read the checkpoint's config, build the model on the target device in the
target dtype, load the weights, settle the FP8 KV scales (``kv_cache_dtype``: the
checkpoint's, else calibrated, :mod:`~pagedinfer.adapters.kv_calibration`), size the KV cache
(:mod:`~pagedinfer.adapters.kv_sizing`: on CUDA after a warm-up pass, from the memory budget;
on the CPU ``num_kv_blocks`` or a share of free RAM), allocate it and bind one view per
attention layer (with its row of ``kv_scales``), then capture the decode graphs on CUDA.

:meth:`ModelRunner.launch` orchestrates one step: the plan becomes tensors in one place
(:meth:`ModelRunner.prepare`: the packer of ``adapters/step_inputs.py``, one host-to-device
copy; the sampling table's deltas), the model runs (or a captured CUDA graph replays), the
logits are computed for the sampled rows only, and rank 0 samples through its
:class:`~pagedinfer.adapters.sampling.pipeline.SamplingPipeline` (the per-slot sampling
table, logits processing, logprobs, structured-output grammars: their token bitmask is
filled on the host right after the forward is launched). A step returns a
:class:`StepOutput` when read.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from pagedinfer.adapters.attention import create_backend
from pagedinfer.adapters.batch_invariant import make_batch_invariant
from pagedinfer.adapters.collective_rpc import RpcMethod, call_on_runner
from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS, ParallelContext
from pagedinfer.adapters.host_kv_tier import host_kv_tier
from pagedinfer.adapters.host_transfers import HostUploads, Readbacks
from pagedinfer.adapters.kv_cache import (
    CALIBRATION_TOKENS,
    allocate_kv_cache,
    is_fp8,
    kv_block_bytes,
    resolve_kv_cache_dtype,
)
from pagedinfer.adapters.kv_calibration import cache_amax, calibration_plan, fp8_kv_scales
from pagedinfer.adapters.kv_groups import runner_kv_layout
from pagedinfer.adapters.kv_sizing import cuda_block_budget, kv_cache_blocks, warm_up_plan
from pagedinfer.adapters.layers.linear import divide
from pagedinfer.adapters.lora.create import create_lora_runtime
from pagedinfer.adapters.models.base import CausalLM
from pagedinfer.adapters.models.loader import load_weights
from pagedinfer.adapters.models.registry import build_model, read_model_config
from pagedinfer.adapters.pooling.pooler import Pooler
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.adapters.sampling.grammar import GrammarCompiler, GrammarStep
from pagedinfer.adapters.sampling.logprobs import LogprobsTensors, prompt_logprobs
from pagedinfer.adapters.sampling.pipeline import SamplingPipeline, read_later
from pagedinfer.adapters.sleep_mode import HostCopy, SleepState, offload_to_host
from pagedinfer.adapters.speculative.draft_model import DraftModelProposer
from pagedinfer.adapters.step_inputs import StepInputs, StepPacker
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.step_output import EMPTY_STEP_OUTPUT, PromptLogprobsChunk, StepOutput
from pagedinfer.errors import ConfigurationError, EngineClosedError

__all__ = ["DecodeGraphRunner", "ModelRunner"]


class DecodeGraphRunner(Protocol):
    """Replays captured CUDA graphs for decode steps (implemented in ``adapters/cuda_graph``)."""

    def bucket_for(self, plan: BatchPlan) -> int | None:
        """The bucket whose graph replays this decode step; None when it runs eagerly."""
        ...

    def replay(self, bucket: int, num_seqs: int) -> torch.Tensor:
        """Replay ``bucket``'s graph (its static inputs hold the step); ``[num_seqs, hidden]``."""
        ...

    def close(self) -> None: ...


class ModelRunner:
    """Executes batch plans on one device (one tensor-parallel rank).

    ``num_kv_blocks`` is the size of the KV pool this runner allocated; the scheduler's block
    pool must have exactly that many blocks. With tensor parallelism every rank runs
    :meth:`execute` on the same plan; rank 0 returns the sampled ids (and logprobs), the
    others an empty :class:`StepOutput`.

    A plan made ahead of the previous step's tokens (async scheduling: ``carried_rows``) gets
    those rows' input ids from the previous step's sampled ids on the device; the previous
    plan must be the one this runner ran last (:attr:`reads_carried_tokens`).
    """

    # Executors that say so run plans with carried rows themselves; the engine fills in the
    # carried tokens on the host for the others (it waits for the previous step's ids).
    reads_carried_tokens = True

    def __init__(
        self,
        config: RunnerConfig,
        parallel: ParallelContext = SINGLE_PROCESS,
        *,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        assert config.tensor_parallel_size == parallel.world_size, (config, parallel)
        self.config = config
        self.parallel = parallel
        self.device = config.device
        self.dtype = config.dtype
        self.model_config = model_config = read_model_config(config.model_path)
        model_config.check_max_model_len(config.max_model_len)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        # The cache's element type: the model's, or float8 (kv_cache_dtype).
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.backend = create_backend(
            config.attention_backend, config.block_size, kv_cache_dtype=config.kv_cache_dtype
        )
        self.model = self._load_model()
        # Hybrid attention: layers grouped by window, one block table per group (empty: one
        # table, every layer in every block, as for any model without a window). The groups
        # are the whole model's on every rank and stage; a block holds this runner's layers.
        kinds = model_config.attention_kinds
        held = [layer.kind.window for layer in self.model.attention_layers()]
        assert held == [kinds[i].window for i in self.held_layers], (held, self.held_layers)
        self.kv_layout = runner_kv_layout(kinds, self.held_layers, config)
        self.kv_groups = () if self.kv_layout is None else self.kv_layout.groups
        self.lora = create_lora_runtime(self.model, model_config, config, parallel)
        # Speculative decoding with a draft model: its cache shares the target's block ids.
        self.drafter: DraftModelProposer | None = None
        if config.draft_model_path is not None:
            if parallel.world_size > 1:
                raise ConfigurationError(
                    "a draft model runs with tensor_parallel_size=1 only (not implemented for "
                    "more ranks): use method 'ngram', or one rank."
                )
            self.drafter = DraftModelProposer(
                config.draft_model_path,
                num_speculative_tokens=config.num_speculative_tokens,
                target_vocab_size=model_config.vocab_size,
                attention_backend=config.attention_backend,
                block_size=config.block_size,
                max_model_len=config.max_model_len,
                device=self.device,
                dtype=self.dtype,
            )
        self.num_kv_heads = divide(
            model_config.num_key_value_heads, parallel.world_size, "num_key_value_heads"
        )
        self.block_bytes = kv_block_bytes(
            num_layers=self.num_block_layers,
            block_size=config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=model_config.head_dim,
            dtype=self.kv_cache_dtype,
        ) + (0 if self.drafter is None else self.drafter.block_bytes)
        # The CPU reads the plan's arrays in place; CUDA packs them into one copy per step.
        self.packer = StepPacker(
            self.device, sampled=parallel.is_driver, zero_copy=self.device.type == "cpu"
        )
        # A step's launch never waits for the device (async scheduling plans a step while
        # the previous one runs): small host lists go up through pinned arenas, the sampled
        # ids come back into pinned buffers reused from a pool (adapters/host_transfers.py).
        self.uploads = HostUploads(self.device)
        self.readbacks = Readbacks(self.device)
        # Rank 0 samples: it keeps every request's sampling parameters by slot, and the
        # state of the per-request features. Structured outputs: the engine's compiler (its
        # cache holds the grammars compiled at submission).
        self.sampling: SamplingPipeline | None = None
        if parallel.is_driver:
            self.sampling = SamplingPipeline(
                max_running=config.max_running,
                vocab_size=model_config.vocab_size,
                eos_token_ids=model_config.eos_token_ids,
                device=self.device,
                seed=config.seed,
                uploads=self.uploads,
                readbacks=self.readbacks,
                grammars=grammars,
                logprobs_mode=config.logprobs_mode,
            )
        # A pooling model (runner="pooling"): rank 0 pools hidden states instead of sampling.
        self.pooler: Pooler | None = None
        if config.pooling_type is not None and parallel.is_driver:
            self.pooler = Pooler(config.pooling_type)
        self._closed = False
        # Decode steps go through graph_runner when it is set; the warm-up pass that sizes
        # the cache runs eagerly, and graphs are captured once the cache is bound.
        self.graph_runner: DecodeGraphRunner | None = None
        # FP8: each layer's [k_scale, v_scale, 1/k_scale, 1/v_scale] and where it came from
        # ("checkpoint" or "calibrated", per layer: "k/v" when they differ).
        self.kv_scales: torch.Tensor | None = None
        self.kv_scale_sources: tuple[str, ...] = ()
        if is_fp8(self.kv_cache_dtype):
            self.kv_scales, self.kv_scale_sources = fp8_kv_scales(
                self.model.attention_layers(),
                kv_cache_dtype=self.kv_cache_dtype,
                device=self.device,
                calibrate=self._calibration_amax,
                log=parallel.is_driver,
            )
        self.num_kv_blocks = self._size_kv_cache()
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        self._bind_kv_cache(self.kv_cache)
        if self.drafter is not None:
            self.drafter.allocate(self.num_kv_blocks)
        self.graph_runner = self._create_graph_runner()
        # Sleep mode (adapters/sleep_mode.py): which halves are asleep; level 1's host copy
        # of the weights (on CUDA).
        self._sleep = SleepState()
        self._host_weights: HostCopy | None = None
        # Host KV tier: blocks evicted from the prefix cache live on in host memory.
        self.host_tier = host_kv_tier(self.kv_cache, config.kv_offloading_bytes)

    def _load_model(self) -> CausalLM:
        """This rank's model, built on the device and loaded from the checkpoint."""
        config = self.config
        model = build_model(
            self.model_config,
            parallel=self.parallel,
            backend=self.backend,
            device=self.device,
            dtype=self.dtype,
        )
        load_weights(model, config.model_path, check=config.weight_check)
        if config.batch_invariant:
            if self.model_config.moe is not None:
                raise ConfigurationError(
                    "batch_invariant=True is not implemented for mixture-of-experts models (the "
                    "rows each expert gets depend on the batch): turn it off for this model."
                )
            make_batch_invariant(model)
        return model

    @property
    def num_host_kv_blocks(self) -> int:
        """The host KV tier's slots (0: no tier)."""
        return self.host_tier.num_slots if self.host_tier is not None else 0

    # ------------------------------------------------------------------ steps
    def execute(self, plan: BatchPlan) -> StepOutput:
        """Run one step; return a token per sampled row, and the logprobs asked for (rank 0;
        other ranks: an empty output)."""
        return self.launch(plan)()

    def launch(self, plan: BatchPlan) -> Callable[[], StepOutput]:
        """Launch one step on the device and return what reads its output: :meth:`execute`
        in two halves. On CUDA the sampled ids are copied into pinned host memory behind the
        step, with an event; the returned callable waits for that event only, so a step
        launched after this one keeps the device busy meanwhile (async scheduling). Call it
        once, before launching a step whose structured-output masks follow this one's
        tokens. The launch itself reads nothing from the device and copies nothing to it
        synchronously; every device-to-host read (ids, logprobs, a draft model's proposals)
        happens in the returned callable."""
        if self._closed:
            raise EngineClosedError("the model runner was used after close()")
        if self._sleep.sleeping:
            raise RuntimeError("the model runner was asked to run a step while asleep")
        if plan.num_seqs == 0:  # only copies between the KV tiers (scheduler/tier.py)
            return self._move_between_tiers(plan)
        inputs = self.prepare(plan)
        sampling = self.sampling
        with torch.inference_mode():
            if plan.carried_rows:
                inputs = self._carry_tokens(plan, inputs)
            if sampling is not None and inputs.table_rows is not None:
                sampling.table.write_rows(*inputs.table_rows)
            if self.host_tier is not None:  # before a fork's copy may overwrite an evicted block
                self._move_between_tiers(plan)
            if plan.block_copies:  # forks' copies of a prompt's last block, before they run
                self._copy_blocks(plan.block_copies)
            hidden = self._run_model(inputs)
            if self.config.pooling_type is not None:  # a pooling model samples nothing
                return self.pooler.pool(plan, hidden) if self.pooler else _ready(EMPTY_STEP_OUTPUT)
            if self.drafter is not None:  # its K/V of the same tokens, in its own cache
                self.drafter.forward(inputs)
            # The host's share of structured outputs, while the device runs the forward.
            grammar = sampling.grammar_step(plan) if sampling is not None else None
            prompt = self._prompt_logprobs(plan, hidden) if plan.prompt_logprob_rows else None
            if plan.num_samples == 0:  # only partial prefill chunks this step
                return lambda: StepOutput([], prompt_logprobs=self._prompt_chunks(plan, prompt))
            if inputs.sample_indices is not None:
                hidden = hidden.index_select(0, inputs.sample_indices)
            logits = self.model.compute_logits(hidden)
            if logits is None or sampling is None:
                return _ready(EMPTY_STEP_OUTPUT)
            return self._sample(plan, inputs, logits, prompt, grammar)

    def prepare(self, plan: BatchPlan) -> StepInputs:
        """The only place a plan becomes tensors (and its sampling deltas reach the table)."""
        sampling = self.sampling
        delta = sampling.begin(plan) if sampling is not None else None
        graphs = self.graph_runner
        bucket = graphs.bucket_for(plan) if graphs is not None else None
        if self.lora is not None:  # each row's adapter, in its device slot
            self.lora.begin(plan, plan.num_tokens if bucket is None else bucket)
        if bucket is not None:  # straight into the graph's static inputs
            return self.packer.pack_graph_decode(plan, bucket, delta)
        return self.packer.pack(plan, delta)

    def _carry_tokens(self, plan: BatchPlan, inputs: StepInputs) -> StepInputs:
        """A plan made ahead of the previous one's tokens (async scheduling): its carried
        rows' input ids are that step's sampled ids, taken from where they are (the device),
        so the host waits for nothing. Runs after the plan's tensors are in place."""
        last = self.sampling.last_sampled if self.sampling is not None else None
        if last is None or last[0] != plan.step_id - 1:
            raise RuntimeError(
                f"plan {plan.step_id} carries tokens sampled by plan {plan.step_id - 1}, which "
                "this runner did not run last (it failed, or ran on another executor): run "
                "the plan that Scheduler.schedule() returns instead."
            )
        rows = self.uploads.upload(plan.carried_rows, torch.int64)
        samples = self.uploads.upload(plan.carried_samples, torch.int64)
        input_ids = inputs.input_ids
        if self.packer.zero_copy:  # a view of the plan's own array: never written
            input_ids = input_ids.clone()
        input_ids.index_copy_(0, rows, last[1].index_select(0, samples))
        return dataclasses.replace(inputs, input_ids=input_ids)

    def _run_model(self, inputs: StepInputs) -> torch.Tensor:
        if inputs.graph_batch is not None:
            assert self.graph_runner is not None
            return self.graph_runner.replay(inputs.graph_batch, int(inputs.input_ids.shape[0]))
        hidden: torch.Tensor = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return hidden

    def _sample(
        self,
        plan: BatchPlan,
        inputs: StepInputs,
        logits: torch.Tensor,
        prompt: Callable[[], LogprobsTensors] | None,
        grammar: GrammarStep | None = None,
    ) -> Callable[[], StepOutput]:
        """Sample (rank 0) and return the read of the step's output: the samples, then a
        draft model's next drafts (its forwards queue from there), then the prompt logprobs."""
        assert self.sampling is not None
        read = self.sampling.sample(
            plan, logits, inputs.sample_slots, inputs.sample_positions, grammar
        )
        drafter = self.drafter

        def output() -> StepOutput:
            sampled = read()
            # Speculative decoding: the next drafts follow these tokens (the draft model
            # decodes from each row's new last token: its forwards are queued from here).
            drafts = drafter.propose(plan, sampled.token_ids) if drafter is not None else None
            return StepOutput(
                sampled.token_ids,
                sampled.logprobs,
                self._prompt_chunks(plan, prompt),
                drafts,
                sampled.failed,
            )

        return output

    def _prompt_logprobs(
        self, plan: BatchPlan, hidden: torch.Tensor
    ) -> Callable[[], LogprobsTensors] | None:
        """Logprobs of the prompt tokens the plan's prompt-logprob rows predict, on the
        device (:meth:`_prompt_chunks` reads them). Every rank runs the LM head over the same
        rows (it may be split across ranks)."""
        rows = plan.prompt_logprob_rows
        indices = [first + i for _, first, count in rows for i in range(count)]
        selected = hidden.index_select(0, self.uploads.upload(indices, torch.int64))
        targets = None
        num_top = 0
        if self.sampling is not None:
            requests = self.sampling.logprobs_requests
            targets = self.uploads.upload(plan.prompt_logprob_targets, torch.int64)
            num_top = max(requests.prompt_num_top(seq_id) for seq_id, _, _ in rows)
        result = prompt_logprobs(self.model.compute_logits, selected, targets, num_top)
        return None if result is None else read_later(self.readbacks, result)

    def _prompt_chunks(
        self, plan: BatchPlan, result: Callable[[], LogprobsTensors] | None
    ) -> list[PromptLogprobsChunk]:
        """:meth:`_prompt_logprobs`' result read on the host, one chunk per sequence."""
        if result is None or self.sampling is None:
            return []
        requests = self.sampling.logprobs_requests
        return requests.prompt_chunks(result(), plan.prompt_logprob_rows, plan.positions)

    def _move_between_tiers(self, plan: BatchPlan) -> Callable[[], StepOutput]:
        """A plan's copies between the device cache and the host KV tier (never a host sync)."""
        tier = self.host_tier
        assert tier is not None, "a plan with KV tier copies needs kv_offloading_size"
        tier.before_step()
        if plan.kv_copies_out or plan.kv_copies_in:
            with torch.inference_mode():
                tier.transfer(self.kv_cache, plan.kv_copies_out, plan.kv_copies_in)
        return _ready(EMPTY_STEP_OUTPUT)

    def _copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy whole KV blocks (every layer, K and V): ``(source, destination)`` pairs."""
        flat = [block for pair in copies for block in pair]
        pairs = self.uploads.upload(flat, torch.int64).view(len(copies), 2)
        cache = self.kv_cache
        if is_fp8(cache.dtype):  # torch has no index_copy_ for float8: copy the bytes
            cache = cache.view(torch.uint8)
        cache.index_copy_(2, pairs[:, 1], cache.index_select(2, pairs[:, 0]))
        if self.drafter is not None:
            self.drafter.copy_blocks(pairs)

    # ------------------------------------------------------------- sleep mode
    @property
    def is_sleeping(self) -> bool:
        return self._sleep.sleeping

    @property
    def weights_asleep(self) -> bool:
        """Whether :meth:`sleep` moved or dropped the weights (not woken up yet)."""
        return self._sleep.weights_asleep

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1; on CUDA the weights move to host memory) or the KV
        cache and the weights (level 2); see ``adapters/sleep_mode.py``."""
        if self._closed:
            raise EngineClosedError("the model runner was used after close()")
        self._sleep.sleep(self, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what :meth:`sleep` freed: ``tags`` ``["weights"]``, ``["kv_cache"]`` or
        ``None`` (both). The KV cache comes back zeroed; level 2's weights from the
        checkpoint."""
        if self._closed:
            raise EngineClosedError("the model runner was used after close()")
        self._sleep.wake_up(self, tags)
        if not self._sleep.sleeping and self.graph_runner is None:
            self.graph_runner = self._create_graph_runner()

    def release_kv_cache(self) -> None:
        if self.graph_runner is not None:  # the graphs record the cache's addresses
            self.graph_runner.close()
            self.graph_runner = None
        if hasattr(self, "model"):
            self._unbind_kv_cache()
        self.kv_cache = torch.empty(0, dtype=self.kv_cache_dtype, device=self.device)
        if self.drafter is not None:
            self.drafter.release_cache()

    def restore_kv_cache(self) -> None:
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        if hasattr(self, "model"):  # else bound when level 2's model is back
            self._bind_kv_cache(self.kv_cache)
        if self.drafter is not None:
            self.drafter.allocate(self.num_kv_blocks)

    def release_weights(self, *, keep_host_copy: bool) -> None:
        if self.graph_runner is not None:
            self.graph_runner.close()
            self.graph_runner = None
        if keep_host_copy:
            if self.device.type != "cpu":
                self._host_weights = offload_to_host(self.model)
            return
        self._host_weights = None
        del self.model

    def restore_weights(self) -> None:
        host = self._host_weights
        if host is not None:
            host.restore(self.device)
            self._host_weights = None
        elif not hasattr(self, "model"):  # level 2: a new model from the checkpoint
            self.model = self._load_model()
            if not self._sleep.kv_cache_asleep:
                self._bind_kv_cache(self.kv_cache)

    def free_device_memory(self) -> None:
        # Parameters reference their modules through their weight loaders (a cycle): the
        # cycle collector frees a dropped model (the KV cache goes with its last reference).
        if self.device.type == "cuda" or not hasattr(self, "model"):
            gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """``method`` on this, the only rank (``adapters/collective_rpc.py``): ``[result]``."""
        if self._closed:
            raise EngineClosedError("the model runner was used after close()")
        return [call_on_runner(self, method, args, kwargs)]

    def close(self) -> None:
        """Free the KV cache and the model. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.graph_runner is not None:
            self.graph_runner.close()
            self.graph_runner = None
        if hasattr(self, "model"):
            self._unbind_kv_cache()
            del self.model
        if self.host_tier is not None:
            self.host_tier.close()
        del self.kv_cache
        self._host_weights = None
        if self.drafter is not None:
            self.drafter.close()
            self.drafter = None
        if self.device.type == "cuda":
            # Parameters reference their modules through their weight loaders (a cycle), so
            # the weights are freed by the cycle collector, not by `del`; run it now so the
            # memory is back before the next engine sizes its cache.
            gc.collect()
            torch.cuda.empty_cache()

    # --------------------------------------------------------------- KV cache
    def _size_kv_cache(self) -> int:
        """This runner's number of blocks (``adapters/kv_sizing.py``); every rank must hold
        the same pool, so the smallest budget over ranks."""
        config = self.config

        def measure_cuda() -> int:
            return cuda_block_budget(
                self.device,
                utilization=config.gpu_memory_utilization,
                block_bytes=self.block_bytes,
                warm_up=self._warm_up,
            )

        num_blocks = kv_cache_blocks(
            config,
            block_bytes=self.block_bytes,
            model=self.model,
            cuda_budget=measure_cuda,
            kv_groups=self.kv_groups,
        )
        return self.parallel.min_over_ranks(num_blocks, self.device)

    def _warm_up(self) -> None:
        """Run the largest step a plan can hold over a one-block cache (nothing is stored),
        then forget its request."""
        self._bind_kv_cache(self._allocate_kv_cache(1))  # slots are -1: nothing is stored
        self.execute(warm_up_plan(self.config))
        self._unbind_kv_cache()
        if self.sampling is not None:
            self.sampling.reset()

    @property
    def held_layers(self) -> range:
        """The decoder layers this runner runs and caches (a pipeline stage: its own)."""
        return range(self.model_config.num_hidden_layers)

    @property
    def num_cache_layers(self) -> int:
        return len(self.held_layers)

    @property
    def num_block_layers(self) -> int:
        """Layers in one block: every cache layer, or (KV groups) this runner's largest
        share of one group."""
        layout = self.kv_layout
        return self.num_cache_layers if layout is None else layout.layers_per_block

    def _allocate_kv_cache(
        self, num_blocks: int, dtype: torch.dtype | None = None, *, every_layer: bool = False
    ) -> torch.Tensor:
        """The cache: ``every_layer`` gives each layer its own pages (calibration), else
        one block holds :attr:`num_block_layers` layers."""
        return allocate_kv_cache(
            num_layers=self.num_cache_layers if every_layer else self.num_block_layers,
            num_blocks=num_blocks,
            block_size=self.config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=self.kv_cache_dtype if dtype is None else dtype,
            device=self.device,
        )

    def _bind_kv_cache(self, kv_cache: torch.Tensor, *, every_layer: bool = False) -> None:
        """Layer ``i`` gets slot ``i`` of a cache with a slot per layer (``every_layer``, or
        no KV groups); with KV groups, its slot in its group, addressed by its group's tables."""
        layers = self.model.attention_layers()
        scales = self.kv_scales if is_fp8(kv_cache.dtype) else None
        layout = self.kv_layout
        grouped = layout is not None and not every_layer
        assert len(layers) == self.num_cache_layers, (len(layers), self.held_layers)
        width = self.num_block_layers if grouped else len(layers)
        assert kv_cache.shape[1] == width, (width, kv_cache.shape)
        for index, layer in enumerate(layers):
            row = scales[index] if scales is not None else None
            slot, group = index, 0
            if grouped:
                assert layout is not None
                slot, group = layout.slot_of_layer[index], layout.group_of_layer[index]
            layer.bind_cache(kv_cache[0, slot], kv_cache[1, slot], row, kv_group=group)

    def _unbind_kv_cache(self) -> None:
        for layer in self.model.attention_layers():
            layer.unbind_cache()

    def _calibration_amax(self) -> list[list[float]]:
        """FP8 calibration (``adapters/kv_calibration.py``): largest ``|K|`` and ``|V|`` per
        layer when the model prefills the calibration prompt into a cache in its own dtype."""
        config = self.config
        length = min(CALIBRATION_TOKENS, config.max_num_batched_tokens, config.max_model_len)
        plan = calibration_plan(
            length, block_size=config.block_size, vocab_size=self.model_config.vocab_size
        )
        cache = self._allocate_kv_cache(plan.block_table_width, dtype=self.dtype, every_layer=True)
        self._bind_kv_cache(cache, every_layer=True)
        try:
            with torch.inference_mode():
                self._run_model(self.packer.pack(plan))
                return cache_amax(cache, self.parallel)
        finally:
            self._unbind_kv_cache()

    def _create_graph_runner(self) -> DecodeGraphRunner | None:
        if (
            self.device.type != "cuda"
            or self.config.enforce_eager
            or not self.backend.supports_cuda_graphs
        ):
            return None
        from pagedinfer.adapters.cuda_graph import (
            DecodeGraphLayout,
            capture_decode_graphs,
            reads_device_values_on_host,
        )

        if reads_device_values_on_host(self.model):  # not capturable: decode runs eagerly
            return None
        config = self.config
        max_running = config.max_running
        layout = DecodeGraphLayout.for_limits(
            max_num_seqs=max_running,
            max_model_len=config.max_model_len,
            block_size=config.block_size,
            # KV groups: a table per group (one sliding group: the plan's own table).
            num_groups=max(len(self.kv_groups), 1),
        )
        static = self.packer.attach_graph_inputs(
            layout.largest, layout.table_width, max_running, num_groups=layout.num_groups
        )
        if self.lora is not None:  # the graphs hold the adapters' matmuls
            self.lora.capture_all()
        return capture_decode_graphs(
            self.model, self.backend, layout=layout, static=static, device=self.device
        )


def _ready(output: StepOutput) -> Callable[[], StepOutput]:
    return lambda: output
