"""The per-slot sampling table: deltas on the host, rows on the device, host-side counts."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pagedinfer.adapters.sampling.table import NO_SEED, SamplingTable
from pagedinfer.domain.sampling import SamplingParams

CPU = torch.device("cpu")


@dataclass(frozen=True)
class New:
    seq_id: int
    slot: int
    params: SamplingParams
    num_prompt_tokens: int


def install(table: SamplingTable, *requests: New, released: tuple[int, ...] = ()) -> int:
    """Apply a delta and write its rows as the runner does; the number of rows written."""
    delta = table.apply(released, requests)
    if delta is None:
        return 0
    table.write_rows(
        torch.frombuffer(delta.slots, dtype=torch.int64),
        torch.frombuffer(delta.floats, dtype=torch.float32),
        torch.frombuffer(delta.ints, dtype=torch.int64),
    )
    return len(delta)


def test_rows_follow_the_slots_of_the_step() -> None:
    table = SamplingTable(8, vocab_size=100, device=CPU)
    install(
        table,
        New(10, 3, SamplingParams(temperature=0.5, top_k=7, seed=11), 4),
        New(11, 0, SamplingParams(temperature=1.5, top_p=0.8), 9),
        New(12, 5, SamplingParams(temperature=0.0), 2),
    )
    rows = table.rows(torch.tensor([5, 3, 0, 3], dtype=torch.int32), torch.tensor([6, 4, 20, 8]))
    assert not rows.all_greedy and rows.any_greedy and rows.any_top_k and rows.any_top_p
    # Slot 0 samples without top-k and slot 5 is greedy: neither widens the topk.
    assert rows.any_seeded and rows.max_top_k == 7
    assert rows.temperatures is not None and rows.top_ks is not None and rows.top_ps is not None
    assert rows.temperatures.tolist() == [0.0, 0.5, 1.5, 0.5]
    assert rows.top_ks.tolist() == [0, 7, 0, 7]
    assert rows.top_ps.tolist() == pytest.approx([1.0, 1.0, 0.8, 1.0])
    assert rows.seeds is not None and rows.seeds.tolist() == [NO_SEED, 11, NO_SEED, 11]
    # Sample step = completion tokens before this one: position + 1 - prompt length.
    assert rows.sample_steps is not None and rows.sample_steps.tolist() == [5, 1, 12, 5]


def test_repeated_deltas_are_idempotent_and_releases_free_slots() -> None:
    table = SamplingTable(4, vocab_size=50, device=CPU)
    first = New(1, 2, SamplingParams(temperature=0.7, top_k=5), 3)
    assert install(table, first) == 1
    assert install(table, first) == 0  # the same request again: nothing to write
    assert len(table) == 1
    replacement = New(2, 2, SamplingParams(temperature=0.9, top_k=9), 3)
    assert install(table, replacement, released=(2,)) == 1
    assert table.params(2).top_k == 9
    rows = table.rows(torch.tensor([2], dtype=torch.int32), None)
    assert rows.max_top_k == 9 and not rows.any_top_p and not rows.any_seeded
    install(table, released=(2,))
    assert len(table) == 0 and table.rows(torch.tensor([], dtype=torch.int32), None).all_greedy


def test_all_greedy_needs_no_device_work() -> None:
    table = SamplingTable(4, vocab_size=50, device=CPU)
    install(table, New(1, 0, SamplingParams(temperature=1e-6), 3))  # below the epsilon
    rows = table.rows(torch.tensor([0], dtype=torch.int32), None)
    assert rows.all_greedy and rows.temperatures is None


def test_counts_track_what_live_requests_need() -> None:
    table = SamplingTable(8, vocab_size=1000, device=CPU)
    install(
        table,
        New(1, 0, SamplingParams(top_k=20), 1),
        New(2, 1, SamplingParams(top_k=40, seed=3), 1),
    )
    rows = table.rows(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 0]))
    assert rows.max_top_k == 40 and rows.any_seeded and not rows.any_greedy
    install(table, released=(1,))
    rows = table.rows(torch.tensor([0], dtype=torch.int32), None)
    assert rows.max_top_k == 20 and not rows.any_seeded and rows.sample_steps is None


def test_callbacks_follow_the_deltas() -> None:
    table = SamplingTable(4, vocab_size=50, device=CPU)
    seen: list[tuple[str, int]] = []
    table.on_install.append(lambda request: seen.append(("install", request.slot)))
    table.on_release.append(lambda slot: seen.append(("release", slot)))
    request = New(1, 3, SamplingParams(), 2)
    install(table, request)
    install(table, request)
    install(table, released=(3, 1))
    assert seen == [("install", 3), ("release", 3)]
