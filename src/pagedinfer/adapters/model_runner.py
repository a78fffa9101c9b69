"""``ModelRunner``: one rank's model, KV cache and sampler; runs a ``BatchPlan`` per call.

Construction: read the checkpoint's config, build the model on the target device in the
target dtype, load the weights, size the KV cache (CUDA: after a warm-up pass, from the memory
budget; CPU: ``num_kv_blocks`` or a share of free RAM), allocate it and bind one view per
attention layer. :meth:`ModelRunner.execute` then turns each plan into tensors in one place
(:meth:`ModelRunner.prepare`: one host-to-device copy, see ``adapters/step_inputs.py``), runs
the model (or replays a captured CUDA graph), computes logits only for the sampled rows and
samples on rank 0, with the parameters of the persistent per-slot sampling table. Rank 0 also
keeps the per-request logits processing state (penalties' token counts, bias and masks:
``sampling/logits_processors.py``) and knows which requests asked for logprobs
(``sampling/logprobs.py``); both follow the table's install / release deltas, and so do the
grammar matchers of structured outputs (``sampling/grammar.py``): their token bitmask is filled
on the host right after the forward is launched (on CUDA it overlaps the forward; on the CPU the
forward has already run) and applied to the logits before anything else. A step returns a
:class:`StepOutput`.

FP8 KV cache (``kv_cache_dtype``): before the cache is sized the runner settles each layer's
K and V scales (the checkpoint's, else calibrated on a fixed prompt: see
:mod:`pagedinfer.adapters.kv_cache`) into ``kv_scales [num_layers, 4]`` and binds row ``i``
to attention layer ``i`` with its cache views.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from array import array
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from pagedinfer.adapters.attention import create_backend
from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS, ParallelContext
from pagedinfer.adapters.host_transfers import HostUploads, Readbacks
from pagedinfer.adapters.kv_cache import (
    CALIBRATION_TOKENS,
    allocate_kv_cache,
    available_host_memory,
    blocks_for_memory,
    calibrated_scale,
    cpu_kv_block_budget,
    cuda_kv_block_budget,
    is_fp8,
    kv_block_bytes,
    kv_cache_dtype_name,
    max_useful_blocks,
    resolve_kv_cache_dtype,
    scale_row,
)
from pagedinfer.adapters.layers.linear import divide
from pagedinfer.adapters.models.loader import load_weights
from pagedinfer.adapters.models.registry import build_model, read_model_config
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.adapters.sampling.failed_rows import failed_samples
from pagedinfer.adapters.sampling.grammar import (
    GrammarCompiler,
    GrammarMatchers,
    GrammarStep,
    apply_token_bitmask,
)
from pagedinfer.adapters.sampling.logits_processors import LogitsProcessors, ProcessingStep
from pagedinfer.adapters.sampling.logprobs import (
    LogprobsRequests,
    LogprobsTensors,
    compute_logprobs,
    gather_logprobs,
    prompt_logprobs,
)
from pagedinfer.adapters.sampling.sampler import Sampler
from pagedinfer.adapters.sampling.table import SamplingTable
from pagedinfer.adapters.speculative.draft_model import DraftModelProposer
from pagedinfer.adapters.speculative.verify import accepted_samples
from pagedinfer.adapters.step_inputs import StepInputs, StepPacker
from pagedinfer.domain.plan import PADDING_SLOT, BatchPlan, NewRequest
from pagedinfer.domain.sampling import SamplingParams
from pagedinfer.domain.step_output import (
    EMPTY_STEP_OUTPUT,
    PromptLogprobsChunk,
    StepOutput,
    TokenLogprobs,
)
from pagedinfer.errors import ConfigurationError, EngineClosedError

__all__ = ["DecodeGraphRunner", "ModelRunner"]

_logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Record:
    """What sampling step ``step_id`` changed in the per-request state (penalty counts, grammar
    matchers), kept until a later plan says the scheduler recorded that step, or undone when
    a plan shows it never will (:meth:`ModelRunner._settle_records`)."""

    step_id: int
    processing: ProcessingStep | None
    token_ids: torch.Tensor
    kept: torch.Tensor | None
    grammar: GrammarStep | None
    grammar_accepted: bool = False


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
        # Structured outputs: the engine's compiler (its cache holds the grammars compiled at
        # submission); only the sampling rank keeps matchers.
        self.grammars = grammars if parallel.is_driver else None
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
        self.model = build_model(
            model_config,
            parallel=parallel,
            backend=self.backend,
            device=self.device,
            dtype=self.dtype,
        )
        load_weights(self.model, config.model_path, check=config.weight_check)
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
            num_layers=self.num_cache_layers,
            block_size=config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=model_config.head_dim,
            dtype=self.kv_cache_dtype,
        ) + (0 if self.drafter is None else self.drafter.block_bytes)
        self.sampler = Sampler(self.device, config.seed)
        # Rank 0 samples: it keeps every request's sampling parameters by slot, and the
        # state of the per-request features (built with the table, following its deltas).
        self.processors: LogitsProcessors | None = None
        self.logprobs_requests: LogprobsRequests | None = None
        self.grammar_matchers: GrammarMatchers | None = None
        self.sampling_table = self._new_sampling_table()
        # The CPU reads the plan's arrays in place; CUDA packs them into one copy per step.
        self.packer = StepPacker(
            self.device, sampled=parallel.is_driver, zero_copy=self.device.type == "cpu"
        )
        # A step's launch never waits for the device (async scheduling plans a step while
        # the previous one runs): small host lists go up through pinned arenas, the sampled
        # ids come back into pinned buffers reused from a pool (adapters/host_transfers.py).
        self.uploads = HostUploads(self.device)
        self.readbacks = Readbacks(self.device)
        self._closed = False
        # The latest step's sampled ids on the device, by its plan's step_id: the inputs of
        # the rows a plan made ahead of that step carries (BatchPlan.carried_rows).
        self._last_sampled: tuple[int, torch.Tensor] | None = None
        # Sampling steps whose record by the scheduler is not known yet (see _settle_records).
        self._unconfirmed: list[_Record] = []
        # Decode steps go through graph_runner when it is set; the warm-up pass that sizes
        # the cache runs eagerly, and graphs are captured once the cache is bound.
        self.graph_runner: DecodeGraphRunner | None = None
        # FP8: each layer's [k_scale, v_scale, 1/k_scale, 1/v_scale] and where it came from
        # ("checkpoint" or "calibrated", per layer: "k/v" when they differ).
        self.kv_scales: torch.Tensor | None = None
        self.kv_scale_sources: tuple[str, ...] = ()
        if is_fp8(self.kv_cache_dtype):
            self.kv_scales, self.kv_scale_sources = self._fp8_scales()
        self.num_kv_blocks = self._size_kv_cache()
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        self._bind_kv_cache(self.kv_cache)
        if self.drafter is not None:
            self.drafter.allocate(self.num_kv_blocks)
        self.graph_runner = self._create_graph_runner()

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
        if self._unconfirmed:  # before the plan's deltas release or reuse any row
            self._settle_records(plan)
        inputs = self.prepare(plan)
        table = self.sampling_table
        with torch.inference_mode():
            if plan.carried_rows:
                inputs = self._carry_tokens(plan, inputs)
            if table is not None and inputs.table_rows is not None:
                table.write_rows(*inputs.table_rows)
            if plan.block_copies:  # forks' copies of a prompt's last block, before they run
                self._copy_blocks(plan.block_copies)
            hidden = self._run_model(inputs)
            if self.drafter is not None:  # its K/V of the same tokens, in its own cache
                self.drafter.forward(inputs)
            # The host's share of structured outputs, while the device runs the forward.
            grammar = self._grammar_step(plan)
            prompt = self._prompt_logprobs(plan, hidden) if plan.prompt_logprob_rows else None
            if plan.num_samples == 0:  # only partial prefill chunks this step
                return lambda: StepOutput([], prompt_logprobs=self._prompt_chunks(plan, prompt))
            if inputs.sample_indices is not None:
                hidden = hidden.index_select(0, inputs.sample_indices)
            logits = self.model.compute_logits(hidden)
            if logits is None or table is None:
                return _ready(EMPTY_STEP_OUTPUT)
            return self._sample(plan, inputs, logits, table, prompt, grammar)

    def _settle_records(self, plan: BatchPlan) -> None:
        """Forget the records of the steps the scheduler recorded (up to
        ``plan.recorded_step_id``), keep the one ``plan`` was made ahead of (still running
        or about to be recorded), and undo the others: their steps were dropped (a failure,
        or Ctrl-C before the record) and their tokens will be sampled again, so the
        penalties must not count them twice nor the grammars advance twice."""
        processors, matchers = self.processors, self.grammar_matchers
        kept: list[_Record] = []
        for record in reversed(self._unconfirmed):  # undo the newest first
            if record.step_id <= plan.recorded_step_id:
                continue
            if plan.made_ahead and record.step_id == plan.step_id - 1:
                kept.append(record)
                continue
            if record.processing is not None and processors is not None:
                processors.record(record.processing, record.token_ids, record.kept, undo=True)
            if record.grammar is not None and record.grammar_accepted and matchers is not None:
                matchers.undo(record.grammar)
        self._unconfirmed = kept[::-1]

    def _carry_tokens(self, plan: BatchPlan, inputs: StepInputs) -> StepInputs:
        """A plan made ahead of the previous one's tokens (async scheduling): its carried
        rows' input ids are that step's sampled ids, taken from where they are (the device),
        so the host waits for nothing. Runs after the plan's tensors are in place."""
        last = self._last_sampled
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

    def _grammar_step(self, plan: BatchPlan) -> GrammarStep | None:
        """The constrained rows' token bitmask on the device, or None (no such row)."""
        matchers = self.grammar_matchers
        if matchers is None or not len(matchers) or plan.num_samples == 0:
            return None
        return matchers.fill(plan.sample_slots)

    def _sample(
        self,
        plan: BatchPlan,
        inputs: StepInputs,
        logits: torch.Tensor,
        table: SamplingTable,
        prompt: Callable[[], LogprobsTensors] | None,
        grammar: GrammarStep | None = None,
    ) -> Callable[[], StepOutput]:
        processors, requests = self.processors, self.logprobs_requests
        assert processors is not None and requests is not None
        if grammar is not None:  # first: logprobs and every later pass see the mask (vLLM's)
            apply_token_bitmask(logits, grammar)
        # Logprobs are of the model's distribution (with the grammar's mask, if any): taken
        # before any other processing.
        wanted = requests.sample_rows(plan.sample_slots)
        raw = rows = None
        if wanted is not None:
            if len(wanted[0]) < plan.num_samples:
                rows = self.uploads.upload(wanted[0], torch.int64)
            raw = compute_logprobs(logits if rows is None else logits.index_select(0, rows))
        processing = None
        if len(processors):
            positions, indices = plan.positions, plan.sample_indices
            processing = processors.plan(
                plan.sample_slots,
                lambda j: positions[indices[j]],
                _draft_history(plan) if plan.verify_rows else None,
            )
        sample_positions = inputs.sample_positions() if table.any_seeded else None
        batch = table.rows(inputs.sample_slots, sample_positions)
        sampled_ids = self.sampler(logits, batch, processors, processing)  # NO_TOKEN: failed
        token_ids = sampled_ids.clamp(min=0)  # for the state below; failed rows end anyway
        self._last_sampled = (plan.step_id, token_ids)  # what a plan made ahead carries
        record = None
        if processing is not None or grammar is not None:
            kept = accepted_samples(plan, token_ids, self.uploads) if plan.verify_rows else None
            if processing is not None:
                processors.record(processing, token_ids, kept)
            record = _Record(plan.step_id, processing, token_ids, kept, grammar)
            self._unconfirmed.append(record)
        top: Callable[[], LogprobsTensors] | None = None
        if wanted is not None and raw is not None:
            chosen = token_ids if rows is None else token_ids.index_select(0, rows)
            top = _read_later(self.readbacks, gather_logprobs(raw, chosen, max(wanted[1])))
        # The step's one device-to-host wait (more with logprobs), when the output is read:
        # on CUDA a copy into pinned memory queued behind the step, and an event after it.
        readback = self.readbacks.start(token_ids)
        matchers = self.grammar_matchers
        drafter = self.drafter

        def output() -> StepOutput:
            sampled = readback.read()  # this step only, not what was launched after it
            if grammar is not None:
                assert matchers is not None and record is not None
                matchers.accept(grammar, sampled)
                record.grammar_accepted = True
            failed = failed_samples(sampled, grammar.failed if grammar is not None else None)
            logprobs: list[TokenLogprobs | None] | None = None
            if top is not None and wanted is not None:
                logprobs = [None] * plan.num_samples
                for row, entry in zip(wanted[0], top().entries(wanted[1]), strict=True):
                    logprobs[row] = entry
            # Speculative decoding: the next drafts follow these tokens (the draft model
            # decodes from each row's new last token: its forwards are queued from here).
            drafts = drafter.propose(plan, sampled) if drafter is not None else None
            return StepOutput(sampled, logprobs, self._prompt_chunks(plan, prompt), drafts, failed)

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
        requests = self.logprobs_requests
        targets = None
        num_top = 0
        if requests is not None:
            targets = self.uploads.upload(plan.prompt_logprob_targets, torch.int64)
            num_top = max(requests.prompt_num_top(seq_id) for seq_id, _, _ in rows)
        result = prompt_logprobs(self.model.compute_logits, selected, targets, num_top)
        return None if result is None else _read_later(self.readbacks, result)

    def _prompt_chunks(
        self, plan: BatchPlan, result: Callable[[], LogprobsTensors] | None
    ) -> list[PromptLogprobsChunk]:
        """:meth:`_prompt_logprobs`' result read on the host, one chunk per sequence."""
        requests = self.logprobs_requests
        if result is None or requests is None:
            return []
        return requests.prompt_chunks(result(), plan.prompt_logprob_rows, plan.positions)

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

    def prepare(self, plan: BatchPlan) -> StepInputs:
        """The only place a plan becomes tensors (and its sampling deltas reach the table)."""
        table = self.sampling_table
        delta = table.apply(plan.released_slots, plan.new_requests) if table is not None else None
        graphs = self.graph_runner
        bucket = graphs.bucket_for(plan) if graphs is not None else None
        if bucket is not None:  # straight into the graph's static inputs
            return self.packer.pack_graph_decode(plan, bucket, delta)
        return self.packer.pack(plan, delta)

    def _run_model(self, inputs: StepInputs) -> torch.Tensor:
        if inputs.graph_batch is not None:
            assert self.graph_runner is not None
            return self.graph_runner.replay(inputs.graph_batch, int(inputs.input_ids.shape[0]))
        hidden: torch.Tensor = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return hidden

    def _new_sampling_table(self) -> SamplingTable | None:
        """The table and the per-request feature state that follows its deltas (rank 0)."""
        if not self.parallel.is_driver:
            return None
        config = self.config
        vocab_size = self.model_config.vocab_size
        table = SamplingTable(
            config.max_running,  # the scheduler's slots are below it
            vocab_size,
            self.device,
        )
        processors = LogitsProcessors(vocab_size, self.device, self.model_config.eos_token_ids)
        requests = LogprobsRequests(vocab_size)
        table.on_install += [processors.install, requests.install]
        table.on_release += [processors.remove, requests.release]
        self.processors, self.logprobs_requests = processors, requests
        self.grammar_matchers = None
        if self.grammars is not None:
            matchers = GrammarMatchers(self.grammars, self.device)
            table.on_install.append(matchers.install)
            table.on_release.append(matchers.release)
            self.grammar_matchers = matchers
        return table

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
        config = self.config
        if config.num_kv_blocks is not None:
            if config.num_kv_blocks < 1:
                raise ConfigurationError(
                    f"num_kv_blocks={config.num_kv_blocks} is invalid: expected an integer >= 1 "
                    "(or None to size the cache from memory)."
                )
            num_blocks = config.num_kv_blocks
        elif config.kv_cache_memory_bytes is not None:
            num_blocks = blocks_for_memory(config.kv_cache_memory_bytes, self.block_bytes)
        elif self.device.type == "cuda":
            num_blocks = self._cuda_block_budget()
        else:
            num_blocks = cpu_kv_block_budget(
                available=available_host_memory(),
                block_bytes=self.block_bytes,
                max_blocks=max_useful_blocks(
                    max_num_seqs=config.max_running,
                    max_model_len=config.max_model_len,
                    block_size=config.block_size,
                ),
                min_blocks=-(-config.max_model_len // config.block_size),
                weight_bytes=sum(p.numel() * p.element_size() for p in self.model.parameters()),
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
        self.sampling_table = self._new_sampling_table()  # forget the warm-up's request
        self._unconfirmed = []
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

    @property
    def num_cache_layers(self) -> int:
        """The decoder layers whose K/V this runner's cache holds (a pipeline stage: its own)."""
        return self.model_config.num_hidden_layers

    def _allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return allocate_kv_cache(
            num_layers=self.num_cache_layers,
            num_blocks=num_blocks,
            block_size=self.config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=self.kv_cache_dtype if dtype is None else dtype,
            device=self.device,
        )

    def _bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        layers = self.model.attention_layers()
        assert len(layers) == kv_cache.shape[1], (len(layers), kv_cache.shape)
        scales = self.kv_scales if is_fp8(kv_cache.dtype) else None
        for index, layer in enumerate(layers):
            row = scales[index] if scales is not None else None
            layer.bind_cache(kv_cache[0, index], kv_cache[1, index], row)

    # ------------------------------------------------------------- FP8 scales
    def _fp8_scales(self) -> tuple[torch.Tensor, tuple[str, ...]]:
        """Each layer's scale row: the checkpoint's scales where it gave them (through
        ``PagedAttention.set_kv_scales``), calibrated ones for the rest."""
        layers = self.model.attention_layers()
        given = [(layer.checkpoint_k_scale, layer.checkpoint_v_scale) for layer in layers]
        amax: list[list[float]] | None = None
        if any(k is None or v is None for k, v in given):
            amax = self._calibration_amax()
        rows: list[list[float]] = []
        sources: list[str] = []
        for index, (k_given, v_given) in enumerate(given):
            chosen: list[float] = []
            kinds: list[str] = []
            for which, value in enumerate((k_given, v_given)):
                if value is None:
                    assert amax is not None
                    value = calibrated_scale(amax[which][index], self.kv_cache_dtype)
                    kinds.append("calibrated")
                else:
                    kinds.append("checkpoint")
                chosen.append(value)
            rows.append(scale_row(*chosen))
            sources.append(kinds[0] if kinds[0] == kinds[1] else "/".join(kinds))
        if self.parallel.is_driver:
            _logger.info(
                "FP8 KV cache (%s): per-layer scales %s",
                kv_cache_dtype_name(self.kv_cache_dtype),
                ", ".join(f"{source} x{sources.count(source)}" for source in sorted(set(sources))),
            )
        scales = torch.tensor(rows, dtype=torch.float32, device=self.device)
        return scales, tuple(sources)

    def _calibration_amax(self) -> list[list[float]]:
        """Largest ``|K|`` and ``|V|`` per layer (``[2][num_layers]``, the maximum over ranks)
        when the model prefills the calibration prompt into a cache in its own dtype."""
        config = self.config
        length = min(CALIBRATION_TOKENS, config.max_num_batched_tokens, config.max_model_len)
        num_blocks = -(-length // config.block_size)
        cache = self._allocate_kv_cache(num_blocks, dtype=self.dtype)
        self._bind_kv_cache(cache)
        try:
            with torch.inference_mode():
                self._run_model(self.packer.pack(self._calibration_plan(length, num_blocks)))
                amax = cache.abs().amax(dim=(2, 3, 4, 5)).to(torch.float32)
        finally:
            self._unbind_kv_cache()
        del cache
        if self.parallel.world_size > 1:  # each rank saw its own heads: agree on the largest
            negated = -amax
            group = self.parallel.group
            if group is not None:
                group.all_reduce(negated, minimum=True)
            else:
                dist.all_reduce(negated, op=dist.ReduceOp.MIN)
            amax = -negated
        values: list[list[float]] = amax.cpu().tolist()
        return values

    def _calibration_plan(self, length: int, num_blocks: int) -> BatchPlan:
        """One sequence of ``length`` pseudo-random tokens (the same ones on every run and
        rank), stored in blocks ``0..num_blocks-1``; nothing is sampled."""
        generator = torch.Generator().manual_seed(0)
        token_ids = torch.randint(self.model_config.vocab_size, (length,), generator=generator)
        return BatchPlan(
            is_prefill=True,
            block_size=self.config.block_size,
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
        from pagedinfer.adapters.cuda_graph import DecodeGraphLayout, capture_decode_graphs

        config = self.config
        max_running = config.max_running
        layout = DecodeGraphLayout.for_limits(
            max_num_seqs=max_running,
            max_model_len=config.max_model_len,
            block_size=config.block_size,
        )
        static = self.packer.attach_graph_inputs(layout.largest, layout.table_width, max_running)
        return capture_decode_graphs(
            self.model, self.backend, layout=layout, static=static, device=self.device
        )


def _draft_history(plan: BatchPlan) -> dict[int, list[int]]:
    """Speculative decoding: the drafts generated before each verify sample (sample ``i`` of
    a verify row follows its drafts ``0..i-1``), by sample index."""
    history: dict[int, list[int]] = {}
    for _, first, drafts in plan.verify_drafts():
        for i in range(1, len(drafts) + 1):
            history[first + i] = drafts[:i]
    return history


def _ready(output: StepOutput) -> Callable[[], StepOutput]:
    return lambda: output


def _read_later(readbacks: Readbacks, result: LogprobsTensors) -> Callable[[], LogprobsTensors]:
    """Start the copies of ``result`` to the host now (behind the step, no wait); the
    returned callable waits for them and gives the tensors on the host."""
    ids, logprobs, ranks = (
        readbacks.start(tensor) for tensor in (result.token_ids, result.logprobs, result.ranks)
    )

    def read() -> LogprobsTensors:
        host = LogprobsTensors(ids.wait().clone(), logprobs.wait().clone(), ranks.wait().clone())
        for readback in (ids, logprobs, ranks):
            readback.release()
        return host

    return read
