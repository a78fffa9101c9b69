"""``StepOutput``: what running one ``BatchPlan`` produced, in plain Python values.

The executor that samples returns one per step: the sampled token of every sample (in
``plan.sample_indices`` order, which is what :meth:`Scheduler.postprocess` takes) and, only
for requests that asked for them, log-probabilities. Ranks that do not sample return
:data:`EMPTY_STEP_OUTPUT`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "EMPTY_STEP_OUTPUT",
    "PooledChunk",
    "PromptLogprobsChunk",
    "StepOutput",
    "TokenLogprobs",
]


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities around one chosen token (a sampled token, or the next prompt token).

    ``token_ids[0]`` / ``logprobs[0]`` are the chosen token's, followed by the ``k`` most
    likely tokens in descending order (their ranks are 1..k); ``rank`` is the chosen token's
    rank (1 = most likely). From the model's distribution before any sampling processing.
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass(frozen=True, slots=True)
class PromptLogprobsChunk:
    """Prompt logprobs of one sequence from one step: entry ``i`` is about the prompt token
    at position ``first_position + i`` (given the tokens before it; ``first_position >= 1``)."""

    seq_id: int
    first_position: int
    entries: list[TokenLogprobs]


@dataclass(frozen=True, slots=True)
class PooledChunk:
    """A pooling model's hidden states of one sequence's prefill chunk (after the final norm):
    ``values`` is the sum of the chunk's ``num_rows`` rows (mean pooling), or one row (last
    token: the prompt's last; CLS: the row at position 0). ``first_position``: the position of
    the first row summed or taken (a recomputation starts again at 0)."""

    seq_id: int
    first_position: int
    num_rows: int
    values: list[float]
    summed: bool = False  # mean pooling: chunks add up; else the chunk's row replaces


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One step's results: a token per sample; logprobs for the samples that asked
    (``None`` entries for the others, ``None`` altogether when none asked); prompt logprobs
    of the prefill chunks that asked; with a draft model (speculative decoding), the drafts it
    proposes for each sequence that got tokens, by sequence id; with a pooling model
    (``runner="pooling"``), the pooled hidden states of the step's prefill chunks.

    ``failed_samples`` maps the index of each sample that failed its own request (its
    structured-output constraint failed or reached a dead end, or its logits held no finite
    allowed value) to why; its entry in ``sampled_token_ids`` is a placeholder (0). The engine
    ends those requests with ``finish_reason="error"``; the other samples are as usual."""

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)
    draft_token_ids: dict[int, list[int]] | None = None
    failed_samples: dict[int, str] | None = None
    pooled: list[PooledChunk] = field(default_factory=list)


EMPTY_STEP_OUTPUT = StepOutput([])
