"""``StageRunner``: a :class:`ModelRunner` that runs one pipeline stage of the model.

It holds only its stage's decoder layers (``ParallelContext.stage``) and their share of the
KV cache: the cache has one slice per layer *of the stage* (with KV groups, hybrid attention:
the whole model's groups, one slice per position of the stage's layers in a group,
``adapters/kv_groups.py``), and every stage holds the same number of blocks (they agree on
the minimum over all ranks, ``ParallelContext.everyone``), so the scheduler's one block pool
and its block tables are valid on every stage.

:meth:`StageRunner.execute_stage` runs a step: the first stage embeds the plan's tokens, the
others continue from the previous stage's :class:`IntermediateTensors`; a stage that is not
the last returns its intermediate tensors (on the CPU: they cross to the next stage through
Ray's object store), the last one samples exactly as a whole-model runner does (its rank 0
is the driver rank: sampling table, logits processors, grammars).

What a stage does not do (yet): capture CUDA graphs (decode runs eagerly) and calibrate an
FP8 KV cache (its calibration pass needs the whole model); both are refused or skipped
explicitly.
"""

from __future__ import annotations

import torch

from pagedinfer.adapters.distributed.parallel import ParallelContext
from pagedinfer.adapters.distributed.pipeline import IntermediateTensors, PipelineStage
from pagedinfer.adapters.model_runner import DecodeGraphRunner, ModelRunner
from pagedinfer.adapters.runner_config import RunnerConfig
from pagedinfer.adapters.sampling.grammar import GrammarCompiler
from pagedinfer.adapters.step_inputs import StepInputs
from pagedinfer.domain.plan import BatchPlan
from pagedinfer.domain.step_output import StepOutput
from pagedinfer.errors import ConfigurationError, EngineClosedError

__all__ = ["StageRunner"]


class StageRunner(ModelRunner):
    """One rank of one pipeline stage (``parallel.stage`` must be set)."""

    def __init__(
        self,
        config: RunnerConfig,
        parallel: ParallelContext,
        *,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        assert parallel.stage is not None, "a StageRunner needs its pipeline stage"
        if config.kv_cache_dtype != "auto":
            raise ConfigurationError(
                f"kv_cache_dtype={config.kv_cache_dtype!r} is not supported with "
                "pipeline_parallel_size > 1 (an FP8 cache calibrates its scales on the whole "
                "model): use kv_cache_dtype='auto' or pipeline_parallel_size=1."
            )
        self.stage: PipelineStage = parallel.stage
        # What the previous stage handed over for the step being run (the last stage reads
        # it inside ModelRunner.execute, through _run_model).
        self._intermediate: IntermediateTensors | None = None
        super().__init__(config, parallel, grammars=grammars)

    @property
    def held_layers(self) -> range:
        """A block holds this stage's layers only (with KV groups: those of the block's
        group; the groups are the whole model's, alike on every stage)."""
        return self.stage.layers

    def execute_stage(
        self, plan: BatchPlan, intermediate: IntermediateTensors | None
    ) -> StepOutput | IntermediateTensors | None:
        """Run this stage's share of ``plan``: the last stage returns the step's output (an
        empty one off the driver rank); the others return their intermediate tensors (on the
        CPU, from rank 0 of the stage only: every rank of a stage holds the same ones)."""
        if self._closed:
            raise EngineClosedError("the model runner was used after close()")
        if intermediate is not None:
            intermediate = intermediate.to(self.device)
        if self.stage.is_last:
            self._intermediate = intermediate
            try:
                return self.execute(plan)
            finally:
                self._intermediate = None
        inputs = self.prepare(plan)
        with torch.inference_mode():
            if plan.block_copies:
                self._copy_blocks(plan.block_copies)
            out = self._forward(inputs, intermediate)
        assert isinstance(out, IntermediateTensors), "a stage before the last hands over"
        return out.to(torch.device("cpu")) if self.parallel.rank == 0 else None

    # ------------------------------------------------------------- overrides
    def _run_model(self, inputs: StepInputs) -> torch.Tensor:
        out = self._forward(inputs, self._intermediate)
        assert isinstance(out, torch.Tensor), "the last stage ends in hidden states"
        return out

    def _forward(
        self, inputs: StepInputs, intermediate: IntermediateTensors | None
    ) -> torch.Tensor | IntermediateTensors:
        if intermediate is None and not self.stage.is_first:
            # The CUDA warm-up pass that sizes the cache: any hidden states do.
            intermediate = IntermediateTensors.zeros(
                int(inputs.input_ids.shape[0]),
                self.model_config.hidden_size,
                dtype=self.dtype,
                device=self.device,
            )
        return self.model.forward_stage(
            inputs.input_ids, inputs.positions, inputs.meta, intermediate
        )

    def _create_graph_runner(self) -> DecodeGraphRunner | None:
        return None  # stages decode eagerly (the graphs capture the whole model's forward)
