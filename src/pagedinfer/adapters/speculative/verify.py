"""Speculative decoding's verification on the device: which samples a verify row keeps.

A verify row samples once per draft plus once after them; it keeps its samples up to the
first that differs from its draft (that one included): the rule of
:func:`~pagedinfer.domain.speculative.accepted_length`. :func:`accepted_samples` applies it
to a step's sampled ids ``[num_samples]`` with tensor ops where they are (the device), so the
step's launch reads nothing back: the plan's drafts and row layout go up through pinned
memory (:class:`~pagedinfer.adapters.host_transfers.HostUploads`).
"""

from __future__ import annotations

import torch

from pagedinfer.adapters.host_transfers import HostUploads
from pagedinfer.domain.plan import BatchPlan

__all__ = ["accepted_samples"]


def accepted_samples(
    plan: BatchPlan, token_ids: torch.Tensor, uploads: HostUploads
) -> torch.Tensor:
    """``[num_samples]`` bool on ``token_ids``' device: the samples a request keeps (every
    sample of a row that is not a verify row)."""
    compared: list[int] = []  # the samples compared with a draft
    drafts: list[int] = []  # the draft each is compared with
    row_first = list(range(plan.num_samples))  # each sample's row's first sample
    for _, first, row_drafts in plan.verify_drafts():
        count = len(row_drafts)
        compared.extend(range(first, first + count))
        drafts.extend(row_drafts)
        for j in range(first, first + count + 1):
            row_first[j] = first
    values = uploads.upload(compared + drafts + row_first, torch.int64)
    index = values[: len(compared)]
    expected = values[len(compared) : 2 * len(compared)].to(token_ids.dtype)
    firsts = values[2 * len(compared) :]
    mismatch = torch.zeros(plan.num_samples, dtype=torch.int64, device=token_ids.device)
    mismatch.index_copy_(0, index, (token_ids.index_select(0, index) != expected).long())
    before = mismatch.cumsum(0) - mismatch  # mismatches before each sample
    return before == before.index_select(0, firsts)
