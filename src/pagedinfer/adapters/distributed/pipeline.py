"""Pipeline parallelism: which decoder layers a stage runs, and what crosses a stage boundary.

``pipeline_parallel_size = P`` splits the ``L`` decoder layers into ``P`` consecutive stages,
as evenly as possible; when ``L`` is not a multiple of ``P`` the stages before the last one
take the extra layers (the last stage also runs the final norm and the LM head), which is
vLLM's split. The first stage embeds the tokens; every other stage starts from the previous
stage's :class:`IntermediateTensors`: the hidden states *and* the residual stream, since the
decoder carries the residual beside the hidden states and adds it inside the next norm.
Sending both keeps a pipelined model's arithmetic identical to the whole model's, so its
tokens are too.

Every rank of a stage (its tensor-parallel group) holds the same hidden states after the
layer's all-reduce, so one rank's copy is enough to feed the whole next stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedinfer.errors import ConfigurationError

__all__ = [
    "IntermediateTensors",
    "PipelineStage",
    "check_pipeline_split",
    "pipeline_stages",
]


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """Stage ``index`` of ``count``: it runs decoder layers ``start .. end - 1``."""

    index: int
    count: int
    start: int
    end: int

    @property
    def is_first(self) -> bool:
        """Embeds the tokens."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Runs the final norm and the LM head, and samples."""
        return self.index == self.count - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


def check_pipeline_split(num_layers: int, pipeline_parallel_size: int) -> None:
    """Raise :class:`ConfigurationError` unless every stage gets at least one layer."""
    if pipeline_parallel_size > num_layers:
        raise ConfigurationError(
            f"pipeline_parallel_size={pipeline_parallel_size} exceeds the model's "
            f"num_hidden_layers={num_layers}: every stage needs at least one decoder layer. "
            f"Use pipeline_parallel_size <= {num_layers}."
        )


def pipeline_stages(num_layers: int, pipeline_parallel_size: int) -> list[PipelineStage]:
    """The stages of a ``num_layers``-layer model split ``pipeline_parallel_size`` ways."""
    check_pipeline_split(num_layers, pipeline_parallel_size)
    count = pipeline_parallel_size
    sizes = [num_layers // count] * count
    # The remainder goes to the stages before the last one, from the last but one backwards.
    for extra in range(num_layers % count):
        sizes[-2 - extra] += 1
    stages: list[PipelineStage] = []
    start = 0
    for index, size in enumerate(sizes):
        stages.append(PipelineStage(index, count, start, start + size))
        start += size
    assert start == num_layers, (num_layers, sizes)
    return stages


@dataclass(frozen=True, slots=True)
class IntermediateTensors:
    """What a stage hands the next one: ``[tokens, hidden]`` hidden states and residual."""

    hidden: torch.Tensor
    residual: torch.Tensor

    def to(self, device: torch.device) -> IntermediateTensors:
        """Both tensors on ``device`` (a no-op where they already are)."""
        return IntermediateTensors(self.hidden.to(device), self.residual.to(device))

    @property
    def nbytes(self) -> int:
        """Bytes that cross the boundary."""
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.residual))

    @staticmethod
    def zeros(
        num_tokens: int, hidden_size: int, *, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """A stand-in for the previous stage's output (the CUDA warm-up pass of a later stage)."""
        shape = (num_tokens, hidden_size)
        return IntermediateTensors(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
