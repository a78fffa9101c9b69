"""``logprobs_mode`` (an engine option, vLLM's): which values the logprobs of sampled tokens
(and their top-k entries) report.

* ``raw_logprobs`` (the default): ``log_softmax`` of the model's logits before any
  processing: no logit bias, ``allowed_token_ids``, ``min_tokens``, penalties, temperature,
  ``min_p``, top-k or top-p. What a trainer's forward over prompt + output computes.
* ``raw_logits``: those logits themselves.
* ``processed_logprobs``: ``log_softmax`` of the logits the sampler drew from: after all of
  the above (temperature, then ``min_p``, top-k and top-p filters, with ``-inf`` at the tokens
  they drop). A greedy row's are the processed logits with no temperature and no filter.
* ``processed_logits``: those logits themselves.

As in vLLM, a structured-output request's grammar mask is applied to the logits before all
of these (the model runner masks them before the sampler): its disallowed tokens are ``-inf``
in every mode. Prompt logprobs are always ``raw_logprobs``'s (vLLM's too).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from pagedinfer.adapters.sampling.batch import SamplingBatch
from pagedinfer.adapters.sampling.logits_processors import LogitsProcessors, ProcessingStep
from pagedinfer.adapters.sampling.logprobs import compute_logprobs
from pagedinfer.adapters.sampling.sampler import sampled_from
from pagedinfer.errors import ConfigurationError

__all__ = [
    "DEFAULT_LOGPROBS_MODE",
    "LOGPROBS_MODES",
    "LogprobsMode",
    "is_processed",
    "logprobs_of",
    "validate_logprobs_mode",
]

LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)
DEFAULT_LOGPROBS_MODE: LogprobsMode = "raw_logprobs"


def validate_logprobs_mode(value: object) -> LogprobsMode:
    """``value`` if it names a :data:`LogprobsMode`; else :class:`ConfigurationError`."""
    if value not in LOGPROBS_MODES:
        raise ConfigurationError(
            f"logprobs_mode={value!r} is unknown: choose one of {', '.join(LOGPROBS_MODES)} "
            "(raw: the model's distribution before any sampling parameter, the default "
            "raw_logprobs; processed: after penalties, bias, temperature and top-k/top-p/min_p, "
            "what the sampler drew from; _logits: the values before log_softmax)."
        )
    return value  # type: ignore[return-value]


def is_processed(mode: LogprobsMode) -> bool:
    """Whether ``mode`` reports the sampler's distribution (taken after processing)."""
    return mode.startswith("processed")


def logprobs_of(
    mode: LogprobsMode,
    logits: torch.Tensor,
    batch: SamplingBatch | None = None,
    processors: LogitsProcessors | None = None,
    processing: ProcessingStep | None = None,
) -> torch.Tensor:
    """The float32 values ``[n, vocab]`` that ``mode`` reports for the rows of ``logits``, in
    a new tensor (``logits`` may be processed in place later). A processed mode needs the
    rows' ``batch`` (and ``processors`` / ``processing`` when the step processes logits)."""
    if mode == "raw_logprobs":
        return compute_logprobs(logits)
    if mode == "raw_logits":
        return logits.to(torch.float32, copy=True)
    assert batch is not None, "a processed logprobs mode needs the rows' sampling batch"
    values = sampled_from(logits, batch, processors, processing)
    return compute_logprobs(values) if mode == "processed_logprobs" else values
