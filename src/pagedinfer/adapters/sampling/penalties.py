"""Repetition, frequency and presence penalties for a batch of logits rows, on the device.

vLLM's (and OpenAI's) rules, one elementwise pass per rule over ``[rows, vocab]``:

- ``repetition_penalty`` (transformers' ``RepetitionPenaltyLogitsProcessor``): the logit of
  every token seen in the prompt *or* the completion is divided by the penalty when positive
  and multiplied by it otherwise, so ``> 1`` always makes a seen token less likely;
- ``frequency_penalty``: subtracted once per occurrence of the token in the completion;
- ``presence_penalty``: subtracted once if the token occurs in the completion at all.

The token history enters as a prompt mask and per-token completion counts (``[rows, vocab]``),
which :class:`~pagedinfer.adapters.sampling.logits_processors.LogitsProcessors` keeps on the
device and updates incrementally after every sample, so no step rebuilds them from token lists.
"""

from __future__ import annotations

import torch

__all__ = ["apply_penalties"]


def apply_penalties(
    logits: torch.Tensor,
    *,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> None:
    """Penalise ``logits [rows, vocab]`` (float32) in place.

    ``prompt_mask [rows, vocab]`` (bool) marks prompt tokens, ``output_counts [rows, vocab]``
    (float32) counts completion tokens; the penalties are ``[rows]`` float32 tensors (neutral
    values: 0, 0 and 1). Masked logits (``-inf``) stay ``-inf``.
    """
    in_output = output_counts > 0
    seen = in_output | prompt_mask
    scale = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
    # Divide positive logits, multiply the others: both move the logit down for a penalty > 1.
    logits.copy_(torch.where(logits > 0, logits / scale, logits * scale))
    logits.sub_(frequency_penalties.unsqueeze(1) * output_counts)
    logits.sub_(presence_penalties.unsqueeze(1) * in_output)
