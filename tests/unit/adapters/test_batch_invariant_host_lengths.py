"""Batch-invariant attention reads the step's lengths from the device once per step (when the
packer gave no host lists, as on CUDA), not once per layer: every ``tolist`` is a host sync."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.unit.kernels.paged_batches import make_batch

from pagedinfer.adapters.batch_invariant import invariant_attention


def test_lengths_are_read_once_per_step_and_give_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = make_batch(
        [1, 1, 5],
        [9, 20, 12],
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        device=torch.device("cpu"),
        num_decode_rows=2,
    )
    k_cache, v_cache = batch.clean_caches()
    with_lists = invariant_attention(batch.query, k_cache, v_cache, batch.meta, batch.scale, None)
    meta = dataclasses.replace(batch.meta, query_lens_host=None, context_lens_host=None, derived={})
    reads: list[tuple[int, ...]] = []
    tolist = torch.Tensor.tolist

    def counted(tensor: torch.Tensor) -> object:
        reads.append(tuple(tensor.shape))
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    outs = [
        invariant_attention(batch.query, k_cache, v_cache, meta, batch.scale, None)
        for _layer in range(3)
    ]
    monkeypatch.undo()
    assert reads == [(4,), (3,)]  # cu_seqlens_q and context_lens, once for the three layers
    for out in outs:
        torch.testing.assert_close(out, with_lists, rtol=0, atol=0)
